"""JSON Schema -> a grammar of the JSON texts of its instances (draft 2020-12; draft-07/-04 spellings).

As the specification says: unknown keywords and annotations are ignored (``title``, ``x-...``,
``id``, ``links``, ``nullable``, ``format`` names we do not know ...); a keyword applies only to
its own type (``{"minLength": 2}`` leaves numbers free). What a grammar cannot enforce is refused
with ``SchemaError`` naming the keyword and its JSON path (``$.properties.tags.uniqueItems``).

Exact (the grammar accepts exactly the valid instances, in the layout below):
    type, enum, const, $ref / $defs / definitions (recursion included), allOf (merged), anyOf,
    properties, required, additionalProperties (false, true, a schema), propertyNames,
    min/maxProperties, items, prefixItems (and draft-07's items array + additionalItems),
    min/maxItems, contains (alone or with minItems <= 1 and no maxItems), integer
    minimum/maximum/exclusive* and multipleOf, number minimum/maximum/exclusive* (written
    without an exponent), string minLength/maxLength/pattern (unanchored, as JSON Schema means it)
Superset (valid instances always accepted, some invalid ones too):
    oneOf (compiled as anyOf: an instance matching two options is not refused),
    patternProperties when a key matches two patterns (its value need only match one of them),
    enum/const beside other keywords (the values are filtered by type only)
Subset (everything generated is valid; some valid spellings are not produced):
    formats date-time, date, time, email, uuid, uri, ipv4, ipv6 (regular approximations: a date
    of 31 February passes; an email must look like local@domain), integers without a fraction
    ("1.0" is not produced), bounded numbers without an exponent
Refused: not, if/then/else, dependentRequired/dependentSchemas/dependencies, unevaluated*,
    uniqueItems (unless maxItems <= 1), minContains > 1 / maxContains, contains beside other
    counts, non-integer multipleOf, $ref outside this document.

Layout: an instance is one line of JSON. Properties come in the schema's ``properties`` order,
then any others; after ``,`` and ``:`` one optional space (json.dumps' default and compact
separators both pass). Strings hold their characters as themselves, escaping only ``"``, ``\\``
and control characters, as ``json.dumps(..., ensure_ascii=False)`` writes them: one spelling per
string, which is what lets "a key other than the declared names" be exact.
"""
from __future__ import annotations

import json
import math
from decimal import Decimal
from functools import lru_cache
from urllib.parse import unquote

import numpy as np

from minillm.generation.constrained.budget import CompileBudget
from minillm.generation.constrained.dfa_ops import byte_dfa, complement, intersect, table_dfa
from minillm.generation.constrained.grammar import Grammar, GrammarError, Ref, Terminal
from minillm.generation.constrained.json_schema import SchemaError, integer_range_regex
from minillm.generation.constrained.regex import (EMPTY, MAX_CODE_POINT, Alternate, Chars, Concat, Repeat,
                                                  RegexError, literal, normalize, parse)

ANNOTATIONS_OF_ALL_TYPES = {"$schema", "$id", "id", "$anchor", "$dynamicAnchor", "$comment", "$vocabulary"}
REFUSED = {"not": "a grammar cannot exclude a language", "if": "conditional schemas are not supported",
           "then": "conditional schemas are not supported", "else": "conditional schemas are not supported",
           "dependentRequired": "dependencies between properties are not supported",
           "dependentSchemas": "dependencies between properties are not supported",
           "dependencies": "dependencies between properties are not supported",
           "unevaluatedProperties": "unevaluated* keywords are not supported",
           "unevaluatedItems": "unevaluated* keywords are not supported",
           "$dynamicRef": "dynamic references are not supported", "$recursiveRef": "dynamic references are not supported"}
TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")

# ---- the lexical pieces, over code points ---------------------------------------------------

SPACE = Repeat(literal(" "), 0, 1)                    # after "," and ":": json.dumps either way
ITEM_SEP, KEY_SEP = Concat((literal(","), SPACE)), Concat((literal(":"), SPACE))
ANY_CHAR = Chars(normalize([(0, MAX_CODE_POINT)]))
_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}


def _escaped(code: int) -> str:
    """How json.dumps(ensure_ascii=False) writes a character that must be escaped."""
    return _ESCAPES.get(code, f"\\u{code:04x}")


def json_chars(ranges) -> object:
    """The characters of `ranges` as they are written inside a JSON string: raw, except `"`, `\\`
    and control characters, which become their escapes."""
    specials = [c for c in [*range(0x20), 0x22, 0x5C] if any(lo <= c <= hi for lo, hi in ranges)]
    plain = [(lo, hi) for lo, hi in ranges]
    for c in specials:
        plain = [piece for lo, hi in plain for piece in ((lo, min(hi, c - 1)), (max(lo, c + 1), hi)) if piece[0] <= piece[1]]
    options = ([Chars(normalize(plain))] if plain else []) + [literal(_escaped(c)) for c in specials]
    return options[0] if len(options) == 1 else Alternate(tuple(options))


def json_content(tree):
    """A regex over a string's characters -> the same over its JSON spelling (escapes included)."""
    if isinstance(tree, Chars):
        return json_chars(tree.ranges)
    if isinstance(tree, Concat):
        return Concat(tuple(json_content(p) for p in tree.parts))
    if isinstance(tree, Alternate):
        return Alternate(tuple(json_content(o) for o in tree.options))
    if isinstance(tree, Repeat):
        return Repeat(json_content(tree.node), tree.lo, tree.hi)
    raise TypeError(tree)


STRING_CHAR = json_chars(ANY_CHAR.ranges)
QUOTE = literal('"')
INTEGER = parse(r"-?(?:0|[1-9][0-9]*)")
NUMBER = parse(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")

_H16 = "[0-9a-fA-F]{1,4}"
_IPV6 = "|".join([f"(?:{_H16}:){{7}}{_H16}"] + [
    (f"(?:{_H16}(?::{_H16}){{{i - 1}}})" if i else "") + "::" + (f"(?:{_H16}(?::{_H16}){{0,{6 - i}}})?" if i < 7 else "")
    for i in range(8)])
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_DATE = r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\.[0-9]+)?(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
FORMATS = {
    "date": _DATE, "time": _TIME, "date-time": f"{_DATE}[Tt]{_TIME}",
    "email": r"[A-Za-z0-9.!#$%&'*+/=?^_`{|}~-]+@[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*",
    "uuid": "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "uri": r"[A-Za-z][A-Za-z0-9+.\-]*:[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]*",
    "ipv4": rf"{_OCTET}(?:\.{_OCTET}){{3}}", "ipv6": _IPV6,
}


# ---- numbers with bounds: regexes over "-?I(.F)?" -------------------------------------------


def _digits(value: Decimal) -> tuple[int, str]:
    """A non-negative decimal as (integer part, fraction digits without trailing zeros)."""
    whole = int(value)
    fraction = format(value - whole, "f")[2:].rstrip("0") if value != whole else ""
    return whole, fraction


def _fraction_at_least(d: str, strict: bool) -> str:
    """The optional '.F' of numbers whose fraction 0.F >= 0.d (> when strict); d has no trailing zeros."""
    options = [f"{d[:i]}[{int(c) + 1}-9][0-9]*" for i, c in enumerate(d) if c != "9"]
    options.append(f"{d}0*[1-9][0-9]*" if strict else (f"{d}[0-9]*" if d else "[0-9]+"))
    fraction = r"\.(?:" + "|".join(options) + ")"
    return f"(?:{fraction})?" if not d and not strict else fraction   # no fraction: 0, >= 0.d only if d = 0


def _fraction_at_most(d: str, strict: bool) -> str:
    """The optional '.F' with 0.F <= 0.d (< when strict; then d must not be empty, 0 < 0 never holds)."""
    options = [f"{d[:i]}[0-{int(c) - 1}][0-9]*" for i, c in enumerate(d) if c != "0"]
    options += [f"{d[:k]}0*" for k in range(1, len(d) + (0 if strict else 1))] + ["0+"]
    return r"(?:\.(?:" + "|".join(options) + "))?"


def magnitude_at_least(a: Decimal, strict: bool) -> str:
    whole, frac = _digits(a)
    same = f"{whole}{_fraction_at_least(frac, strict)}"
    above = integer_range_regex(whole + 1, None) + r"(?:\.[0-9]+)?"
    return f"(?:{same}|{above})"


def magnitude_at_most(b: Decimal, strict: bool) -> str | None:
    whole, frac = _digits(b)
    options = [integer_range_regex(0, whole - 1) + r"(?:\.[0-9]+)?"] if whole >= 1 else []
    if frac or not strict:
        options.append(f"{whole}{_fraction_at_most(frac, strict)}")
    return "(?:" + "|".join(options) + ")" if options else None


def number_bound_regex(bound: Decimal, strict: bool, lower: bool) -> str:
    """Numbers without exponent x >= bound (lower) or x <= bound, '>' / '<' when strict."""
    anything = r"(?:0|[1-9][0-9]*)(?:\.[0-9]+)?"
    if lower:
        if bound >= 0:
            return magnitude_at_least(bound, strict)
        below = magnitude_at_most(-bound, strict)
        return f"(?:{anything}|-{below})"
    if bound < 0:
        return "-" + magnitude_at_least(-bound, strict)
    upto = magnitude_at_most(bound, strict)
    return f"(?:-{anything}|{upto})" if upto else "-" + magnitude_at_least(Decimal(0), True)   # x < 0


# ---- the compiler ---------------------------------------------------------------------------


def schema_to_grammar(schema, budget: CompileBudget | None = None) -> Grammar:
    """The grammar of `schema`'s instances (see the module docstring). Raises SchemaError."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise SchemaError(f"the schema is not valid JSON: {e}") from None
    compiler = _Compiler(schema, budget or CompileBudget())
    compiler.grammar.rules["root"] = compiler.node(schema, "$")
    return compiler.grammar


def json_object_grammar() -> Grammar:
    """Any JSON object (OpenAI's json_object mode), nested to any depth."""
    compiler = _Compiler({}, CompileBudget())
    compiler.grammar.rules["root"] = compiler.any_object()
    return compiler.grammar


class _Compiler:
    def __init__(self, root, budget: CompileBudget):
        self.root, self.budget = root, budget
        self.grammar = Grammar("root")
        self.shared: dict[object, str] = {}      # body -> rule name: equal bodies share one rule
        self.refs: dict[str, str] = {}           # JSON pointer -> the rule of its target

    def rule(self, hint: str, body) -> Ref:
        name = self.shared.get(body)
        if name is None:
            name = f"{hint}_{len(self.grammar.rules)}"
            self.grammar.rules[name] = body
            self.shared[body] = name
            self.budget.count("grammar_rules", len(self.grammar.rules))
        return Ref(name)

    def terminal(self, hint: str, key: str, make) -> Ref:
        """A rule given as a byte DFA, built once per key."""
        name = self.shared.get(("terminal", key))
        if name is None:
            name = f"{hint}_{len(self.grammar.rules)}"
            self.grammar.rules[name] = Terminal(make(), key)
            self.shared[("terminal", key)] = name
            self.budget.count("grammar_rules", len(self.grammar.rules))
        return Ref(name)

    # ---- generic JSON ----------------------------------------------------------------

    def any_value(self) -> Ref:
        if "value" not in self.grammar.rules:
            self.grammar.rules["value"] = None   # reserve the name: the body refers to itself
            body = Alternate((Ref("object"), Ref("array"), self.any_string(), Ref("number"), literal("true"),
                              literal("false"), literal("null")))
            self.grammar.rules["number"] = NUMBER
            self.grammar.rules["array"] = Concat((literal("["), Repeat(Concat((Ref("value"), Repeat(
                Concat((ITEM_SEP, Ref("value"))), 0, None))), 0, 1), literal("]")))
            pair = Concat((self.any_string(), KEY_SEP, Ref("value")))
            self.grammar.rules["object"] = Concat((literal("{"), Repeat(Concat((pair, Repeat(
                Concat((ITEM_SEP, pair)), 0, None))), 0, 1), literal("}")))
            self.grammar.rules["value"] = body
        return Ref("value")

    def any_object(self) -> Ref:
        self.any_value()
        return Ref("object")

    def any_string(self) -> Ref:
        return self.rule("string", Concat((QUOTE, Repeat(STRING_CHAR, 0, None), QUOTE)))

    # ---- schemas ---------------------------------------------------------------------

    def node(self, schema, path: str):
        self.budget.check_time()
        if schema is True or schema == {}:
            return self.any_value()
        if schema is False:
            raise SchemaError(f"the schema at {path} is false: no instance is valid")
        if not isinstance(schema, dict):
            raise SchemaError(f"the schema at {path} must be an object or a boolean, got {type(schema).__name__}")
        for key, why in REFUSED.items():
            if key in schema and not (key in ("then", "else") and "if" not in schema):
                raise SchemaError(f"{key} at {path} is not supported: {why}")
        schema = _draft4_bounds(self.merge_all_of(schema, path))
        if "$ref" in schema:
            return self.reference(schema, path)
        options = [k for k in ("anyOf", "oneOf") if k in schema]
        if options:
            return self.alternatives(schema, options[0], path)
        if "enum" in schema or "const" in schema:
            return self.enumeration(schema, path)
        types = schema.get("type", list(TYPES))
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or not types or any(t not in TYPES for t in types):
            raise SchemaError(f"type at {path} must be one of {', '.join(TYPES)} or a non-empty list of them")
        if "integer" in types and "number" in types and "multipleOf" not in schema:
            types = [t for t in types if t != "integer"]   # every integer is a number
        compiled = [self.typed(t, schema, path) for t in types]
        return compiled[0] if len(compiled) == 1 else Alternate(tuple(compiled))

    def resolve(self, ref, path: str):
        """The schema a local $ref points at."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaError(f"$ref {ref!r} at {path}: only references inside this schema (#...) are supported")
        target = self.root
        for part in [unquote(p).replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/")[1:]]:
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise SchemaError(f"$ref {ref!r} at {path} points at nothing")
        return target

    def reference(self, schema: dict, path: str):
        ref = schema["$ref"]
        rest = {k: v for k, v in schema.items() if k not in ("$ref", "$defs", "definitions") and not _annotation(k)}
        target = self.resolve(ref, path)
        if rest:   # 2020-12: $ref beside other keywords is allOf of both
            return self.node({"allOf": [target, rest]}, path)
        if ref not in self.refs:   # named before compiling: a recursive reference finds it
            self.refs[ref] = f"ref_{len(self.grammar.rules)}"
            self.grammar.rules[self.refs[ref]] = None
            body = self.node(target, ref)
            self.grammar.rules[self.refs[ref]] = body
        return Ref(self.refs[ref])

    def merge_all_of(self, schema: dict, path: str) -> dict:
        """allOf folded into its schema, keyword by keyword, where the merge is exact."""
        if "allOf" not in schema:
            return schema
        parts = schema["allOf"]
        if not isinstance(parts, list) or not parts:
            raise SchemaError(f"allOf at {path} must be a non-empty list")
        merged = {k: v for k, v in schema.items() if k != "allOf"}
        for i, part in enumerate(parts):
            where = f"{path}.allOf[{i}]"
            if part is True:
                continue
            if not isinstance(part, dict):
                raise SchemaError(f"the schema at {where} is false or not an object")
            if "$ref" in part:
                target = self.resolve(part["$ref"], where)
                if target is schema or (isinstance(target, dict) and "allOf" in target and schema in target["allOf"]):
                    raise SchemaError(f"allOf at {where} refers back to itself")
                part = {"allOf": [target, {k: v for k, v in part.items() if k != "$ref"}]}
            part = self.merge_all_of(part, where)
            merged = _merge(merged, part, where)
        return merged

    def alternatives(self, schema: dict, keyword: str, path: str):
        options = schema[keyword]
        if not isinstance(options, list) or not options:
            raise SchemaError(f"{keyword} at {path} must be a non-empty list")
        rest = {k: v for k, v in schema.items() if k != keyword}
        compiled = []
        for i, option in enumerate(options):
            if option is False:
                continue
            option = {} if option is True else option
            combined = {"allOf": [rest, option]} if any(not _annotation(k) for k in rest) else option
            compiled.append(self.node(combined, f"{path}.{keyword}[{i}]"))
        if not compiled:
            raise SchemaError(f"every option of {keyword} at {path} is false")
        return compiled[0] if len(compiled) == 1 else Alternate(tuple(compiled))

    def enumeration(self, schema: dict, path: str):
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not isinstance(values, list) or not values:
            raise SchemaError(f"enum at {path} must be a non-empty list")
        if "type" in schema:
            types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
            values = [v for v in values if any(_is_type(v, t) for t in types)]
        if "enum" in schema and "const" in schema:
            values = [v for v in values if any(_json_equal(v, e) for e in schema["enum"])]
        if not values:
            raise SchemaError(f"no value of enum/const at {path} is valid")
        options = [value_literal(v) for v in values]
        return options[0] if len(options) == 1 else Alternate(tuple(options))

    def typed(self, kind: str, schema: dict, path: str):
        if kind == "string":
            return self.string(schema, path)
        if kind == "integer":
            return self.integer(schema, path)
        if kind == "number":
            return self.number(schema, path)
        if kind == "boolean":
            return Alternate((literal("true"), literal("false")))
        if kind == "null":
            return literal("null")
        if kind == "array":
            return self.array(schema, path)
        return self.object(schema, path)

    # ---- strings ---------------------------------------------------------------------

    def string(self, schema: dict, path: str) -> Ref:
        dfa_key = json.dumps({k: schema.get(k) for k in ("minLength", "maxLength", "pattern", "format")},
                             sort_keys=True)
        return self.terminal("string", dfa_key, lambda: self.string_dfa(schema, path))

    def string_dfa(self, schema: dict, path: str):
        """The byte DFA of the JSON spelling (quotes included) of the strings `schema` allows."""
        lo, hi = _count(schema, "minLength", path), _count(schema, "maxLength", path, None)
        if hi is not None and hi < lo:
            raise SchemaError(f"maxLength < minLength at {path}: no string is valid")
        contents = [Repeat(STRING_CHAR, lo, hi)]
        if "pattern" in schema:
            contents.append(json_content(pattern_tree(schema["pattern"], f"{path}.pattern")))
        fmt = schema.get("format")
        if isinstance(fmt, str) and fmt in FORMATS:
            contents.append(parse(FORMATS[fmt]))
        dfa = None
        for content in contents:
            part = byte_dfa(Concat((QUOTE, content, QUOTE)), self.budget)
            dfa = part if dfa is None else intersect(dfa, part, self.budget)
        return dfa

    # ---- numbers ---------------------------------------------------------------------

    def integer(self, schema: dict, path: str):
        lo, hi = None, None
        for key, bound in (("minimum", math.ceil), ("exclusiveMinimum", lambda x: math.floor(x) + 1)):
            if (value := _bound(schema, key, path)) is not None:
                lo = bound(value) if lo is None else max(lo, bound(value))
        for key, bound in (("maximum", math.floor), ("exclusiveMaximum", lambda x: math.ceil(x) - 1)):
            if (value := _bound(schema, key, path)) is not None:
                hi = bound(value) if hi is None else min(hi, bound(value))
        if lo is not None and hi is not None and lo > hi:
            raise SchemaError(f"no integer lies within the bounds at {path}")
        step = self.integer_step(schema, path)
        if step is None:
            return INTEGER if lo is None and hi is None else parse(integer_range_regex(lo, hi))
        key = json.dumps([lo, hi, step])
        return self.terminal("integer", key, lambda: intersect(
            byte_dfa(parse(integer_range_regex(lo, hi)) if lo is not None or hi is not None else INTEGER),
            multiple_of_dfa(step), self.budget))

    @staticmethod
    def integer_step(schema: dict, path: str) -> int | None:
        """multipleOf as an integer step (None: no constraint on integers)."""
        if "multipleOf" not in schema:
            return None
        m = schema["multipleOf"]
        if isinstance(m, bool) or not isinstance(m, (int, float)) or m <= 0:
            raise SchemaError(f"multipleOf at {path} must be a number > 0")
        if float(m).is_integer():
            return int(m) if int(m) > 1 else None
        if (1 / m).is_integer():
            return None   # every integer is a multiple of 1/k
        raise SchemaError(f"multipleOf {m} at {path} is not supported: only integer steps are")

    def number(self, schema: dict, path: str):
        if "multipleOf" in schema:   # integer-valued numbers only: the multiples of an integer step
            return self.integer(schema, path)
        bounds = []
        for key, lower, strict in (("minimum", True, False), ("exclusiveMinimum", True, True),
                                   ("maximum", False, False), ("exclusiveMaximum", False, True)):
            value = _bound(schema, key, path)
            if value is not None:
                bounds.append(number_bound_regex(Decimal(repr(value)) if isinstance(value, float) else Decimal(value),
                                                 strict, lower))
        if not bounds:
            return NUMBER
        key = json.dumps(bounds)

        def make():
            dfa = None
            for b in bounds:
                part = byte_dfa(parse(b), self.budget)
                dfa = part if dfa is None else intersect(dfa, part, self.budget)
            return dfa
        return self.terminal("number", key, make)

    # ---- arrays ----------------------------------------------------------------------

    def array(self, schema: dict, path: str):
        lo, hi = _count(schema, "minItems", path), _count(schema, "maxItems", path, None)
        if hi is not None and hi < lo:
            raise SchemaError(f"maxItems < minItems at {path}: no array is valid")
        if schema.get("uniqueItems") is True and (hi is None or hi > 1):
            raise SchemaError(f"uniqueItems at {path} is not supported: a grammar cannot compare items")
        prefix = schema.get("prefixItems", [])
        items = schema.get("items", True)
        rest = items
        if isinstance(items, list):                # draft-07: items as a tuple, then additionalItems
            prefix, rest = items, schema.get("additionalItems", True)
        if not isinstance(prefix, list):
            raise SchemaError(f"prefixItems at {path} must be a list")
        elements = [self.element(s, f"{path}.prefixItems[{i}]") for i, s in enumerate(prefix)]
        rest_node = None if rest is False else self.element(rest, f"{path}.items")
        if rest_node is None:
            hi = len(prefix) if hi is None else min(hi, len(prefix))
            if hi < lo:
                raise SchemaError(f"minItems at {path} needs more items than prefixItems allows")
        if "contains" in schema:
            return self.array_containing(schema, prefix, rest, lo, hi, path)
        body = _sequence(elements, rest_node, lo, hi)
        return self.rule("array", Concat((literal("["), body, literal("]"))))

    def element(self, schema, path: str) -> Ref:
        node = self.node(schema, path)
        return node if isinstance(node, Ref) else self.rule("item", node)

    def array_containing(self, schema, prefix, rest, lo, hi, path):
        contains = schema["contains"]
        least = _count(schema, "minContains", path, 1)
        if prefix or "maxContains" in schema or least > 1 or lo > 1 or hi is not None:
            raise SchemaError(f"contains at {path} beside prefixItems, maxItems, minItems > 1 or min/maxContains "
                              f"is not supported")
        if least == 0:
            return self.rule("array", Concat((literal("["), _sequence([], self.element(rest, path), lo, hi),
                                              literal("]"))))
        item = self.element(rest, f"{path}.items")
        hit = self.element({"allOf": [rest if isinstance(rest, dict) else {}, contains]}, f"{path}.contains")
        before = Repeat(Concat((item, ITEM_SEP)), 0, None)
        after = Repeat(Concat((ITEM_SEP, item)), 0, None)
        return self.rule("array", Concat((literal("["), before, hit, after, literal("]"))))

    # ---- objects ---------------------------------------------------------------------

    def object(self, schema: dict, path: str):
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise SchemaError(f"properties at {path} must be an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"required at {path} must be a list of names")
        patterns = schema.get("patternProperties", {})
        extra = schema.get("additionalProperties", True)
        names = schema.get("propertyNames", True)
        name_dfa = None if names is True else self.key_dfa(names, f"{path}.propertyNames")
        declared = list(props) + [r for r in required if r not in props]
        fields = []
        for name in declared:
            if name_dfa is not None and not name_dfa.fullmatch(json.dumps(name, ensure_ascii=False).encode()):
                if name in required:
                    raise SchemaError(f"required property {name!r} at {path} does not satisfy propertyNames")
                continue
            value = self.property_schema(name, props, patterns, extra, path)
            if value is False:
                if name in required:
                    raise SchemaError(f"required property {name!r} at {path} is not allowed by the schema")
                continue
            pair = Concat((value_literal(name), KEY_SEP, self.element(value, f"{path}.properties.{name}")))
            fields.append((pair, name in required))
        additional = self.additional_pairs(declared, patterns, extra, name_dfa, path)
        lo, hi = _count(schema, "minProperties", path), _count(schema, "maxProperties", path, None)
        body = self.members(fields, additional, lo, hi, path)
        return self.rule("object", Concat((literal("{"), body, literal("}"))))

    def property_schema(self, name: str, props: dict, patterns: dict, extra, path: str):
        """The schema a declared (or required) property's value must satisfy."""
        parts = [props[name]] if name in props else []
        for pattern, sub in patterns.items():
            if pattern_dfa(pattern, f"{path}.patternProperties").fullmatch(json.dumps(name, ensure_ascii=False).encode()):
                parts.append(sub)
        if not parts:
            parts = [extra]
        if any(p is False for p in parts):
            return False
        parts = [p for p in parts if p is not True]
        return True if not parts else parts[0] if len(parts) == 1 else {"allOf": parts}

    def key_dfa(self, names, path: str):
        """The byte DFA of the keys propertyNames allows (the JSON spelling, quotes included)."""
        if names is False:
            return _nothing()
        if not isinstance(names, dict):
            raise SchemaError(f"propertyNames at {path} must be a schema")
        if "enum" in names or "const" in names:
            values = [names["const"]] if "const" in names else names["enum"]
            keys = [v for v in values if isinstance(v, str)]
            if not keys:
                return _nothing()
            return byte_dfa(Alternate(tuple(value_literal(k) for k in keys)))
        known = {"type", "minLength", "maxLength", "pattern", "format"}
        if unknown := [k for k in names if k in ("anyOf", "oneOf", "allOf", "$ref")]:
            raise SchemaError(f"{unknown[0]} inside propertyNames at {path} is not supported")
        return self.string_dfa({k: v for k, v in names.items() if k in known}, path)

    def additional_pairs(self, declared, patterns, extra, name_dfa, path):
        """One pair of a property outside `declared`, or None when no such property may appear."""
        key = json.dumps([declared, sorted(patterns), extra is False, name_dfa is None])
        others = None
        options = []
        base = byte_dfa(Concat((QUOTE, Repeat(STRING_CHAR, 0, None), QUOTE)))
        if declared:
            base = intersect(base, complement(byte_dfa(Alternate(tuple(value_literal(n) for n in declared)))))
        if name_dfa is not None:
            base = intersect(base, name_dfa)
        for i, (pattern, sub) in enumerate(patterns.items()):
            if sub is False:
                continue
            keys = intersect(base, pattern_dfa(pattern, f"{path}.patternProperties"))
            options.append(Concat((self.terminal("key", f"{key}/{i}", lambda k=keys: k), KEY_SEP,
                                   self.element(sub, f"{path}.patternProperties.{pattern}"))))
        if extra is not False:
            others = base
            for pattern in patterns:
                others = intersect(others, complement(pattern_dfa(pattern, f"{path}.patternProperties")))
            options.append(Concat((self.terminal("key", f"{key}/rest", lambda: others), KEY_SEP,
                                   self.element(extra, f"{path}.additionalProperties"))))
        if not options:
            return None
        return self.rule("pair", options[0] if len(options) == 1 else Alternate(tuple(options)))

    def members(self, fields, additional, lo: int, hi: int | None, path: str):
        """The declared pairs in order (optional ones skippable), then any additional pairs, ","
        between the present ones, and between lo and hi of them in all.

        rest(i, n): the text from field i on with n pairs written so far. Counts beyond what the
        bounds can tell apart are merged (cap), and each (i, n) is one rule, shared by the paths
        that reach it: the pairs written form a DAG, never a tree of copies."""
        cap = max(lo, hi if hi is not None else 0, 1)
        memo: dict[tuple[int, int], object] = {}

        def rest(i: int, n: int):
            if (i, n) in memo:
                return memo[(i, n)]
            options = []
            sep = (ITEM_SEP,) if n else ()
            if i < len(fields):
                pair, required = fields[i]
                if hi is None or n < hi:
                    options.append(Concat((*sep, pair, rest(i + 1, min(n + 1, cap)))))
                if not required:
                    options.append(rest(i + 1, n))
            else:
                need = max(lo - n, 0)
                most = None if hi is None else hi - n
                if additional is not None and (most is None or most > 0):
                    first = Concat((*sep, additional))
                    more = Repeat(Concat((ITEM_SEP, additional)), max(need - 1, 0), None if most is None else most - 1)
                    options.append(Concat((first, more)))
                if need == 0:
                    options.append(EMPTY)
            if not options:
                node = None
            else:
                options = [o for o in options if o is not None and not _has_none(o)]
                node = None if not options else self.rule("members", options[0] if len(options) == 1
                                                          else Alternate(tuple(options)))
            memo[(i, n)] = node
            return node

        body = rest(0, 0)
        if body is None:
            raise SchemaError(f"no object satisfies the property counts and names at {path}")
        return body


# ---- helpers ---------------------------------------------------------------------------------


def _has_none(node) -> bool:
    return isinstance(node, Concat) and any(p is None for p in node.parts)


@lru_cache(maxsize=1)
def _nothing():
    """A DFA that accepts nothing: the complement of every byte string."""
    return complement(byte_dfa(Repeat(Chars(((0, 255),)), 0, None)))


def _sequence(elements: list, rest, lo: int, hi: int | None):
    """Array content: element i follows elements[i] (then `rest`; None: nothing more), lo..hi of them."""
    m = max(len(elements), lo)
    positions = elements + [rest] * (m - len(elements))
    if any(p is None for p in positions[:lo]):
        raise SchemaError("minItems needs more items than the array allows")

    def tail(i: int):
        """The content after i elements."""
        if i >= m:
            if rest is None or (hi is not None and hi <= i):
                return EMPTY
            return Repeat(Concat((ITEM_SEP, rest)), max(lo - i, 0), None if hi is None else hi - i)
        options = [EMPTY] if i >= lo else []
        if positions[i] is not None and (hi is None or i < hi):
            options.append(Concat((ITEM_SEP, positions[i], tail(i + 1))))
        return options[0] if len(options) == 1 else Alternate(tuple(options))

    if hi == 0 or not positions and rest is None:
        return EMPTY
    first = positions[0] if positions else rest
    content = Concat((first, tail(1)))
    return Alternate((EMPTY, content)) if lo == 0 else content


def value_literal(value):
    """Exactly `value`'s JSON texts: compact or default separators, numbers as integers or floats."""
    if isinstance(value, dict):
        if not value:
            return literal("{}")
        parts = [literal("{")]
        for k, (key, v) in enumerate(value.items()):
            parts += ([ITEM_SEP] if k else []) + [literal(json.dumps(key, ensure_ascii=False)), KEY_SEP, value_literal(v)]
        return Concat((*parts, literal("}")))
    if isinstance(value, list):
        if not value:
            return literal("[]")
        parts = [literal("[")]
        for k, v in enumerate(value):
            parts += ([ITEM_SEP] if k else []) + [value_literal(v)]
        return Concat((*parts, literal("]")))
    if isinstance(value, float) and value.is_integer():   # 1.0 == 1 in JSON Schema
        return Alternate((literal(json.dumps(int(value))), literal(json.dumps(value))))
    if isinstance(value, int) and not isinstance(value, bool):
        return Alternate((literal(json.dumps(value)), literal(json.dumps(float(value)))))
    return literal(json.dumps(value, ensure_ascii=False))


def pattern_tree(pattern, path: str):
    """A JSON Schema pattern (ECMA-262, unanchored: it may match anywhere) as a full-match tree."""
    if not isinstance(pattern, str):
        raise SchemaError(f"pattern at {path} must be a string")
    try:
        tree = parse(pattern)
    except RegexError as e:
        raise SchemaError(f"pattern at {path} is not supported: {e}") from None
    anything = Repeat(ANY_CHAR, 0, None)
    start = () if pattern.startswith("^") else (anything,)
    end = () if pattern.endswith("$") and not pattern.endswith("\\$") else (anything,)
    return Concat((*start, tree, *end))


@lru_cache(maxsize=256)
def pattern_dfa(pattern: str, path: str):
    """The byte DFA of the JSON spelling of strings containing a match of `pattern`."""
    return byte_dfa(Concat((QUOTE, json_content(pattern_tree(pattern, path)), QUOTE)))


def multiple_of_dfa(step: int):
    """Decimal integers ("-"? no leading zeros) divisible by `step`: the states are the residues."""
    # states: 0 start, 1 after "-", 2 the integer "0", 3 + r: residue r of a number not starting with 0
    table = np.full((3 + step, 256), -1, dtype=np.int32)
    table[0, ord("-")] = 1
    for s in (0, 1):
        table[s, ord("0")] = 2
        for d in range(1, 10):
            table[s, ord("0") + d] = 3 + d % step
    for r in range(step):
        for d in range(10):
            table[3 + r, ord("0") + d] = 3 + (10 * r + d) % step
    accepting = np.zeros(3 + step, dtype=bool)
    accepting[2] = accepting[3] = True
    return table_dfa(table, accepting)


def _annotation(key: str) -> bool:
    return key in ANNOTATIONS_OF_ALL_TYPES or key in ("title", "description", "default", "examples", "deprecated",
                                                       "readOnly", "writeOnly", "$defs", "definitions")


def _merge(a: dict, b: dict, path: str) -> dict:
    """Two schemas that must both hold, as one schema (exact merges only)."""
    out = dict(a)
    for key, value in b.items():
        if key not in out or out[key] == value or _annotation(key):
            out.setdefault(key, value)
            continue
        mine = out[key]
        if key == "required":
            out[key] = list(dict.fromkeys([*mine, *value]))
        elif key == "properties":
            out[key] = {n: (mine[n] if n not in value else value[n] if n not in mine else {"allOf": [mine[n], value[n]]})
                        for n in list(dict.fromkeys([*mine, *value]))}
        elif key == "type":
            left = {mine} if isinstance(mine, str) else set(mine)
            right = {value} if isinstance(value, str) else set(value)
            both = (left & right) | ({"integer"} if "integer" in left | right and "number" in left & right or
                                     ("integer" in left and "number" in right) or
                                     ("number" in left and "integer" in right) else set())
            if not both:
                raise SchemaError(f"allOf at {path}: the types {mine!r} and {value!r} have nothing in common")
            out[key] = sorted(both)
        elif key in ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties"):
            out[key] = max(mine, value)
        elif key in ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties"):
            out[key] = min(mine, value)
        elif key == "enum":
            out[key] = [v for v in mine if any(_json_equal(v, w) for w in value)]
        elif key in ("anyOf", "oneOf") and key not in b.get("__merged__", ()):
            out[key] = [{"allOf": [x, y]} for x in mine for y in value]
        elif key in ("items", "additionalProperties", "contains", "propertyNames") and \
                isinstance(mine, dict) and isinstance(value, dict):
            out[key] = {"allOf": [mine, value]}
        else:
            raise SchemaError(f"allOf at {path}: {key!r} differs between the schemas and cannot be merged")
    return out


def _json_equal(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _count(schema: dict, key: str, path: str, default: int | None = 0) -> int | None:
    value = schema.get(key, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if value is not default and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        raise SchemaError(f"{key} at {path} must be an integer >= 0, got {value!r}")
    return value


def _draft4_bounds(schema: dict) -> dict:
    """Draft-04's boolean exclusiveMinimum/Maximum (true: minimum/maximum is exclusive) in 2020-12 terms."""
    out = dict(schema)
    for bound, flag in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if isinstance(out.get(flag), bool):
            if out.pop(flag) and bound in out:
                out[flag] = out.pop(bound)
    return out


def _bound(schema: dict, key: str, path: str):
    """A numeric bound (None when absent)."""
    value = schema.get(key)
    if value is None or isinstance(value, bool):
        return None
    if not isinstance(value, (int, float)):
        raise SchemaError(f"{key} at {path} must be a number, got {value!r}")
    return value


def _is_type(value, kind: str) -> bool:
    return {"string": isinstance(value, str), "boolean": isinstance(value, bool), "null": value is None,
            "integer": isinstance(value, int) and not isinstance(value, bool) or
            isinstance(value, float) and value.is_integer(),
            "number": isinstance(value, (int, float)) and not isinstance(value, bool),
            "array": isinstance(value, list), "object": isinstance(value, dict)}.get(kind, False)
