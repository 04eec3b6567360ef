r"""JSON Schema -> a grammar of the JSON texts of its instances (draft 2020-12; draft-07/-04 spellings).

As the specification says: unknown keywords and annotations are ignored (``title``, ``x-...``,
``id``, ``links``, ``nullable``, ``format`` names we do not know ...); a keyword applies only to
its own type (``{"minLength": 2}`` leaves numbers free). What a grammar cannot enforce is refused
with ``SchemaError`` naming the keyword and its JSON path (``$.properties.tags.uniqueItems``).

Exact (the grammar accepts exactly the valid instances, in the layout below):
    type, enum, const, $ref / $defs / definitions / $anchor (recursion included; draft-07's $ref
    overrides its siblings), allOf (merged keyword by keyword, additionalProperties and
    prefixItems/items across branches included), anyOf, properties, required,
    additionalProperties (false, true, a schema), patternProperties (keys split by the set of
    patterns they match), propertyNames, min/maxProperties, items, prefixItems (and draft-07's
    items array + additionalItems), min/maxItems, contains (alone or with minItems <= 1 and no
    maxItems), integer minimum/maximum/exclusive* and multipleOf, number minimum/maximum/exclusive*
    and decimal multipleOf (written without an exponent), string minLength/maxLength/pattern
    (unanchored, as JSON Schema means it), formats date, uuid, ipv4, ipv6, uri (RFC 3986 without
    IPvFuture);
    not, and if/then/else as anyOf(allOf(if, then), allOf(not if, else)), wherever the negated
    schema is made of what negation.py can complement: type, enum/const of scalars, the counts and
    bounds of strings, numbers, arrays and objects, pattern, format, multipleOf, required,
    properties, items, contains, and allOf/anyOf/oneOf/not/if/$ref of those;
    uniqueItems (maxItems > 1) over scalar items - strings, numbers, booleans, null, enums of those
    - checked at run time beside the grammar (unique_items.py: values compared, 1 == 1.0);
    enum/const beside string and number keywords and array/object counts (each value is checked)
Superset (valid instances always accepted, some invalid ones too):
    oneOf (compiled as anyOf: an instance matching two options is not refused; under not it is
    exact), an enum/const value that is an array or an object beside items/properties-like
    keywords (only its type, counts and required names are checked)
Subset (everything generated is valid; some valid spellings are not produced):
    integers are written without a fraction ("1.0" is not produced); bounded numbers, multipleOf,
    numbers under a negated keyword (not minimum, not enum ...) and the items of uniqueItems
    arrays without an exponent; formats time and date-time without leap seconds, email as
    local@domain only; dates from year 0001 (Python's, which validators use)
Refused: dependentRequired/dependentSchemas/dependencies, unevaluated*, minContains > 1 /
    maxContains, contains beside other counts, multipleOf whose automaton would pass 20,000
    states, $ref outside this document, $dynamicRef, \p{...} in patterns; not (or an if with then
    or else) whose negation needs additionalProperties, patternProperties, propertyNames,
    prefixItems, uniqueItems, min/maxContains, an enum value that is an array or an object, or a
    $ref back into the negated schema; uniqueItems over items that may be arrays or objects, or
    beside prefixItems/contains; allOf branches whose pattern, format or contains differ. A schema
    with no valid instance is refused as ``Unsatisfiable``; an unsatisfiable option, property or
    item is left out instead.

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
from fractions import Fraction
from functools import lru_cache
from urllib.parse import unquote

import numpy as np

from minillm.generation.constrained.automata import DFA
from minillm.generation.constrained.budget import CompileBudget
from minillm.generation.constrained.dfa_ops import byte_dfa, complement, intersect, table_dfa, union
from minillm.generation.constrained.grammar import Grammar, Ref, Terminal, UniqueItems
from minillm.generation.constrained.json_schema import (MAX_BOUND, SchemaError, decimal_digits, draft4_bounds,
                                                       integer_range_regex, number_spellings)
from minillm.generation.constrained.negation import EXCLUDED_NUMBERS, EXCLUDED_STRINGS, Negator, all_of, any_of
from minillm.generation.constrained.unique_items import distinct_values
from minillm.generation.constrained.regex import (EMPTY, MAX_CODE_POINT, MAX_REPEAT, Alternate, Chars, Concat, Repeat,
                                                  RegexError, literal, normalize, parse)

ANNOTATIONS_OF_ALL_TYPES = {"$schema", "$id", "id", "$anchor", "$dynamicAnchor", "$comment", "$vocabulary"}
REFUSED = {"dependentRequired": "dependencies between properties are not supported",
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
PLAIN_NUMBER = parse(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?")        # no exponent
EXPONENT_NUMBER = parse(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?[eE][+-]?[0-9]+")   # kept out of uniqueItems arrays
INTEGRAL = parse(r"-?(?:0|[1-9][0-9]*)(?:\.0+)?")                # the integers among PLAIN_NUMBER

_H16 = "[0-9a-fA-F]{1,4}"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4 = rf"{_OCTET}(?:\.{_OCTET}){{3}}"
_LS32 = f"(?:{_H16}:{_H16}|{_IPV4})"


def _groups(n: int) -> str:
    """Up to n 16-bit groups before "::" (RFC 3986's [ *(n-1)( h16 ":" ) h16 ])."""
    return "" if n < 0 else f"(?:{_H16}(?::{_H16}){{0,{n - 1}}})?" if n else ""


_IPV6 = "|".join([f"(?:{_H16}:){{6}}{_LS32}", f"::(?:{_H16}:){{5}}{_LS32}"]
                 + [f"{_groups(i)}::" + (f"(?:{_H16}:){{{4 - i}}}" if i < 4 else "") + _LS32 for i in range(1, 5)]
                 + [f"{_groups(5)}::{_H16}", f"{_groups(6)}::"])
# RFC 3986's URI (IPvFuture left out): scheme ":" hier-part ["?" query] ["#" fragment]
_PCT = "%[0-9A-Fa-f]{2}"
_UNRESERVED_SUB = r"A-Za-z0-9\-._~!$&'()*+,;="
_PCHAR = f"(?:[{_UNRESERVED_SUB}:@]|{_PCT})"
_SEGMENT, _SEGMENT_NZ = f"{_PCHAR}*", f"{_PCHAR}+"
_AUTHORITY = (f"(?:(?:[{_UNRESERVED_SUB}:]|{_PCT})*@)?"
              f"(?:\\[(?:{_IPV6})\\]|(?:[{_UNRESERVED_SUB}]|{_PCT})*)(?::[0-9]*)?")
_HIER = (f"(?://{_AUTHORITY}(?:/{_SEGMENT})*|/(?:{_SEGMENT_NZ}(?:/{_SEGMENT})*)?|{_SEGMENT_NZ}(?:/{_SEGMENT})*|)")
_URI = f"[A-Za-z][A-Za-z0-9+.\\-]*:{_HIER}(?:\\?(?:{_PCHAR}|[/?])*)?(?:#(?:{_PCHAR}|[/?])*)?"
_YEAR = "(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"   # not 0000: Python dates start at year 1
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         f"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)")
# no leap second (":60"): whether one is valid depends on the offset; leaving it out only narrows
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
FORMATS = {
    "date": _DATE, "time": _TIME, "date-time": f"{_DATE}[Tt]{_TIME}",
    "email": r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(?:\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*@[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
             r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*",
    "uuid": "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "uri": _URI,
    "ipv4": _IPV4, "ipv6": _IPV6,
}


# ---- numbers with bounds: regexes over "-?I(.F)?" -------------------------------------------


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
    whole, frac = decimal_digits(a)
    same = f"{whole}{_fraction_at_least(frac, strict)}"
    above = integer_range_regex(whole + 1, None) + r"(?:\.[0-9]+)?"
    return f"(?:{same}|{above})"


def magnitude_at_most(b: Decimal, strict: bool) -> str | None:
    whole, frac = decimal_digits(b)
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


def schema_to_grammar(schema, budget: CompileBudget | None = None, draft: str | None = None) -> Grammar:
    """The grammar of `schema`'s instances (see the module docstring). Raises SchemaError.

    `draft` ("2020-12", "7", "4"; default: from ``$schema``, else 2020-12) decides one thing: before
    2019-09 a ``$ref`` overrides the keywords beside it, since then it is one more constraint."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise SchemaError(f"the schema is not valid JSON: {e}") from None
    if draft is None:
        declared = schema.get("$schema", "") if isinstance(schema, dict) else ""
        draft = next((d for d in ("4", "6", "7") if f"draft-0{d}" in str(declared)), "2020-12")
    compiler = _Compiler(schema, budget or CompileBudget(), ref_overrides=draft in ("4", "6", "7"))
    compiler.grammar.rules["root"] = compiler.node(schema, "$")
    return compiler.grammar


def json_object_grammar() -> Grammar:
    """Any JSON object (OpenAI's json_object mode), nested to any depth."""
    compiler = _Compiler({}, CompileBudget())
    compiler.grammar.rules["root"] = compiler.any_object()
    return compiler.grammar


class Unsatisfiable(SchemaError):
    """No instance satisfies the schema (false, types with nothing in common, bounds that cross).
    Where an alternative, a property or an item is unsatisfiable it is simply left out."""


class _Compiler:
    def __init__(self, root, budget: CompileBudget, ref_overrides: bool = False):
        self.root, self.budget, self.ref_overrides = root, budget, ref_overrides
        self.grammar = Grammar("root")
        self.shared: dict[object, str] = {}      # body -> rule name: equal bodies share one rule
        self.refs: dict[str, str] = {}           # JSON pointer -> the rule of its target
        self.key_sets: dict[str, list] = {}      # additional_pairs' key -> split_keys' answer
        self.string_dfas: dict[str, DFA] = {}    # _string_key -> string_dfa's answer
        self.unique_items: dict[object, DFA] = {}   # a uniqueItems array's item node -> its item DFA
        self.merging: list[str] = []             # the $refs an allOf merge is inside: met again, it would never end
        self.negator = Negator(self.resolve, ref_overrides, set(FORMATS))

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
            dfa = make()
            if not dfa.accepting.any():
                raise Unsatisfiable(f"no {hint} satisfies all of {key}")
            name = f"{hint}_{len(self.grammar.rules)}"
            self.grammar.rules[name] = Terminal(dfa, key)
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
            raise Unsatisfiable(f"the schema at {path} is false: no instance is valid")
        if not isinstance(schema, dict):
            raise SchemaError(f"the schema at {path} must be an object or a boolean, got {type(schema).__name__}")
        schema = draft4_bounds(self.merge_all_of(self.desugar(schema, path), path))
        if not schema:   # e.g. not: false
            return self.any_value()
        for key, why in REFUSED.items():
            if key in schema:
                raise SchemaError(f"{key} at {path} is not supported: {why}")
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
        compiled = self.satisfiable([lambda t=t: self.typed(t, schema, path) for t in types],
                                    f"no type of {types} at {path} has a valid instance")
        return compiled[0] if len(compiled) == 1 else Alternate(tuple(compiled))

    @staticmethod
    def satisfiable(makers, message: str) -> list:
        """The nodes of the alternatives that have instances; Unsatisfiable if none has."""
        out = []
        for make in makers:
            try:
                out.append(make())
            except Unsatisfiable:
                continue
        if not out:
            raise Unsatisfiable(message)
        return out

    def resolve(self, ref, path: str):
        """The schema a local $ref points at."""
        base = self.root.get("$id", self.root.get("id")) if isinstance(self.root, dict) else None
        if isinstance(ref, str) and isinstance(base, str) and ref.startswith(base.rstrip("#")):
            ref = "#" + ref[len(base.rstrip("#")):].lstrip("#")     # the root's own address
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaError(f"$ref {ref!r} at {path}: only references inside this schema (#...) are supported")
        if ref[1:2] not in ("", "/"):                                  # "#name": an $anchor (or a draft-07 "$id": "#name")
            found = _find_anchor(self.root, ref[1:])
            if found is None:
                raise SchemaError(f"$ref {ref!r} at {path} names no $anchor of this schema")
            return found
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
        if rest and not self.ref_overrides:   # 2020-12: $ref beside other keywords is allOf of both
            return self.node({"allOf": [target, rest]}, path)
        if ref not in self.refs:   # named before compiling: a recursive reference finds it
            name = self.refs[ref] = f"ref_{len(self.grammar.rules)}"
            self.grammar.rules[name] = None
            try:
                self.grammar.rules[name] = self.node(target, ref)
            except SchemaError:
                del self.refs[ref], self.grammar.rules[name]
                raise
        return Ref(self.refs[ref])

    def desugar(self, schema: dict, path: str) -> dict:
        """not and if/then/else written with allOf/anyOf (negation.py): then and else without an
        if are ignored, as the specification says; draft-07's $ref ignores them all."""
        if not any(k in schema for k in ("not", "if", "then", "else")) or ("$ref" in schema and self.ref_overrides):
            return schema
        parts = [{k: v for k, v in schema.items() if k not in ("not", "if", "then", "else")}]
        if "not" in schema:
            parts.append(self.negator.negate(schema["not"], path))
        if "if" in schema and (schema.get("then", True) is not True or schema.get("else", True) is not True):
            condition = schema["if"]
            parts.append(any_of([all_of([condition, schema.get("then", True)]),
                                 all_of([self.negator.negate(condition, path, "if"), schema.get("else", True)])]))
        merged = all_of(parts)
        if merged is False:
            raise Unsatisfiable(f"the schema at {path} has no valid instance")
        return {} if merged is True else merged

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
            if part is False:
                raise Unsatisfiable(f"the schema at {where} is false: no instance is valid")
            if not isinstance(part, dict):
                raise SchemaError(f"the schema at {where} must be an object or a boolean")
            if "$ref" in part and self.ref_overrides:
                part = {"$ref": part["$ref"]}
            ref = part.get("$ref")
            if ref is not None:
                target = self.resolve(ref, where)
                if target is schema or ref in self.merging or \
                        (isinstance(target, dict) and "allOf" in target and schema in target["allOf"]):
                    raise SchemaError(f"allOf at {where} refers back to itself")
                part = {"allOf": [target, {k: v for k, v in part.items() if k != "$ref"}]}
                self.merging.append(ref)
            try:
                part = self.merge_all_of(self.desugar(part, where), where)
            finally:
                if ref is not None:
                    self.merging.pop()
            merged = _merge(merged, part, where)
        return merged

    def alternatives(self, schema: dict, keyword: str, path: str):
        options = schema[keyword]
        if not isinstance(options, list) or not options:
            raise SchemaError(f"{keyword} at {path} must be a non-empty list")
        rest = {k: v for k, v in schema.items() if k != keyword}
        makers = []
        for i, option in enumerate(options):
            option = {} if option is True else option
            combined = {"allOf": [rest, option]} if any(not _annotation(k) for k in rest) else option
            makers.append(lambda c=combined, i=i: self.node(c, f"{path}.{keyword}[{i}]"))
        compiled = self.satisfiable(makers, f"no option of {keyword} at {path} has a valid instance")
        return compiled[0] if len(compiled) == 1 else Alternate(tuple(compiled))

    def enumeration(self, schema: dict, path: str):
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not isinstance(values, list):
            raise SchemaError(f"enum at {path} must be a list")
        if not values:
            raise Unsatisfiable(f"enum at {path} is empty: no instance is valid")
        if "type" in schema:
            types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
            values = [v for v in values if any(_is_type(v, t) for t in types)]
        if "enum" in schema and "const" in schema:
            values = [v for v in values if any(_json_equal(v, e) for e in schema["enum"])]
        values = [v for v in values if self.value_keywords_hold(v, schema, path)]
        if not values:
            raise Unsatisfiable(f"no value of enum/const at {path} is valid")
        options = [value_literal(v) for v in values]
        return options[0] if len(options) == 1 else Alternate(tuple(options))

    def value_keywords_hold(self, value, schema: dict, path: str) -> bool:
        """Whether an enum/const value satisfies the keywords beside it: all string and number
        keywords, and the counts of arrays and objects (not their items and properties)."""
        if isinstance(value, str):
            if not any(k in schema for k in ("minLength", "maxLength", "pattern", "format", EXCLUDED_STRINGS)):
                return True
            try:
                return self.string_dfa(schema, path).fullmatch(json.dumps(value, ensure_ascii=False).encode())
            except Unsatisfiable:
                return False
        if isinstance(value, bool) or value is None:
            return True
        if isinstance(value, (int, float)):
            return _number_keywords_hold(_decimal(value), schema, path)
        size = len(value)
        low, high = ("minItems", "maxItems") if isinstance(value, list) else ("minProperties", "maxProperties")
        if size < _count(schema, low, path) or size > (_count(schema, high, path, None) or size):
            return False
        return isinstance(value, list) or all(name in value for name in schema.get("required", []))

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
        return self.terminal("string", _string_key(schema), lambda: self.string_dfa(schema, path))

    def string_dfa(self, schema: dict, path: str):
        """The byte DFA of the JSON spelling (quotes included) of the strings `schema` allows (built
        once per set of string keywords: an enum checks each of its values against it)."""
        key = _string_key(schema)
        if key not in self.string_dfas:
            self.string_dfas[key] = self.build_string_dfa(schema, path)
        return self.string_dfas[key]

    def build_string_dfa(self, schema: dict, path: str):
        lo, hi = _count(schema, "minLength", path), _count(schema, "maxLength", path, None)
        if hi is not None and hi < lo:
            raise Unsatisfiable(f"maxLength < minLength at {path}: no string is valid")
        dfas = [string_length_dfa(lo, hi)]
        contents = []
        if "pattern" in schema:
            contents.append(json_content(pattern_tree(schema["pattern"], f"{path}.pattern")))
        fmt = schema.get("format")
        if isinstance(fmt, str) and fmt in FORMATS:
            contents.append(parse(FORMATS[fmt]))
        dfas += [byte_dfa(Concat((QUOTE, content, QUOTE)), self.budget) for content in contents]
        dfas += [complement(self.string_set_dfa(excluded, path)) for excluded in schema.get(EXCLUDED_STRINGS, [])]
        dfa = dfas[0]
        for part in dfas[1:]:
            dfa = intersect(dfa, part, self.budget)
        return dfa

    def string_set_dfa(self, excluded: dict, path: str):
        """The byte DFA of the strings one EXCLUDED_STRINGS entry stands for (quotes included)."""
        if "enum" in excluded:
            return byte_dfa(Alternate(tuple(value_literal(v) for v in excluded["enum"])), self.budget)
        if "pattern" in excluded:
            return pattern_dfa(excluded["pattern"], f"{path}.not.pattern")
        return byte_dfa(Concat((QUOTE, parse(FORMATS[excluded["format"]]), QUOTE)), self.budget)

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
            raise Unsatisfiable(f"no integer lies within the bounds at {path}")
        step = multiple_of(schema, path)
        excluded = schema.get(EXCLUDED_NUMBERS, [])
        if step is None and not excluded:
            return INTEGER if lo is None and hi is None else parse(integer_range_regex(lo, hi))

        def make():
            dfa = byte_dfa(parse(integer_range_regex(lo, hi)) if lo is not None or hi is not None else INTEGER)
            if step is not None:
                dfa = intersect(dfa, multiple_of_dfa(*step, fraction=False), self.budget)
            for entry in excluded:
                dfa = intersect(dfa, complement(self.number_set_dfa(entry, path)), self.budget)
            return dfa
        return self.terminal("integer", json.dumps([lo, hi, step, excluded]), make)

    def number(self, schema: dict, path: str):
        bounds = []
        for key, lower, strict in (("minimum", True, False), ("exclusiveMinimum", True, True),
                                   ("maximum", False, False), ("exclusiveMaximum", False, True)):
            value = _bound(schema, key, path)
            if value is not None:
                bounds.append(number_bound_regex(Decimal(repr(value)) if isinstance(value, float) else Decimal(value),
                                                 strict, lower))
        step = multiple_of(schema, path)
        excluded = schema.get(EXCLUDED_NUMBERS, [])
        if not bounds and step is None and not excluded:
            return NUMBER

        def make():
            parts = [byte_dfa(parse(b), self.budget) for b in bounds] or [byte_dfa(PLAIN_NUMBER)]
            parts += [multiple_of_dfa(*step, fraction=True)] if step is not None else []
            parts += [complement(self.number_set_dfa(entry, path)) for entry in excluded]
            dfa = parts[0]
            for part in parts[1:]:
                dfa = intersect(dfa, part, self.budget)
            return dfa
        return self.terminal("number", json.dumps([bounds, step, excluded]), make)

    def number_set_dfa(self, excluded: dict, path: str):
        """The byte DFA of every spelling without exponent of the numbers one EXCLUDED_NUMBERS
        entry stands for (1, 1.0, 1.00 ... and -0 for 0)."""
        if "enum" in excluded:
            return byte_dfa(Alternate(tuple(parse(number_spellings(v)) for v in excluded["enum"])), self.budget)
        if "multipleOf" in excluded:
            return multiple_of_dfa(*multiple_of(excluded, f"{path}.not"), fraction=True)
        return byte_dfa(INTEGRAL, self.budget)

    # ---- arrays ----------------------------------------------------------------------

    def array(self, schema: dict, path: str):
        lo, hi = _count(schema, "minItems", path), _count(schema, "maxItems", path, None)
        if hi is not None and hi < lo:
            raise Unsatisfiable(f"maxItems < minItems at {path}: no array is valid")
        if schema.get("uniqueItems") is True and (hi is None or hi > 1):
            return self.unique_array(schema, lo, hi, path)
        prefix = schema.get("prefixItems", [])
        items = schema.get("items", True)
        rest = items
        if isinstance(items, list):                # draft-07: items as a tuple, then additionalItems
            prefix, rest = items, schema.get("additionalItems", True)
        if not isinstance(prefix, list):
            raise SchemaError(f"prefixItems at {path} must be a list")
        elements = []
        for i, sub in enumerate(prefix):
            try:
                elements.append(self.element(sub, f"{path}.prefixItems[{i}]"))
            except Unsatisfiable:   # no item may stand at position i: the array ends before it
                prefix, rest = prefix[:i], False
                break
        try:
            rest_node = None if rest is False else self.element(rest, f"{path}.items")
        except Unsatisfiable:
            rest_node, rest = None, False
        if rest_node is None:
            hi = len(prefix) if hi is None else min(hi, len(prefix))
            if hi < lo:
                raise Unsatisfiable(f"minItems at {path} needs more items than prefixItems allows")
        if "contains" in schema:
            return self.array_containing(schema, prefix, rest, lo, hi, path)
        body = _sequence(elements, rest_node, lo, hi)
        return self.rule("array", Concat((literal("["), body, literal("]"))))

    def unique_array(self, schema: dict, lo: int, hi: int | None, path: str):
        """An array whose items must be distinct: the grammar of an array of scalar items, marked for
        the run-time check (unique_items.py). Items that may be arrays or objects are refused."""
        if any(k in schema for k in ("prefixItems", "contains")) or isinstance(schema.get("items"), list):
            raise SchemaError(f"uniqueItems at {path} is not supported beside prefixItems, an items array or "
                              f"contains")
        try:
            node = self.node(schema.get("items", True), f"{path}.items")
        except Unsatisfiable:   # no item is valid: only the empty array
            if lo:
                raise
            return literal("[]")
        if node not in self.unique_items:   # the same items in several branches (if/then, anyOf): built once
            item = self.flat_dfa(node, path)
            if (item.byte_table()[0, [ord("-"), *range(ord("0"), ord("9") + 1)]] >= 0).any():   # numbers: no exponent
                item = intersect(item, _no_exponent(), self.budget)
            self.unique_items[node] = item
        item = self.unique_items[node]
        if not item.accepting.any() or not distinct_values(item, lo):
            raise Unsatisfiable(f"the items at {path} have fewer than minItems = {lo} distinct values")
        item_rule = self.terminal("unique_item", repr(node), lambda: item)
        array = self.rule("unique_array", Concat((literal("["), _sequence([], item_rule, lo, hi), literal("]"))))
        self.grammar.unique[array.name] = UniqueItems(item, lo)
        return array

    def flat_dfa(self, node, path: str, seen: tuple[str, ...] = ()):
        """The byte DFA of an item node whose language is regular and holds no array or object."""
        refused = SchemaError(f"uniqueItems at {path} is not supported for items that may be arrays or objects "
                              f"(only strings, numbers, booleans and null are compared at run time)")
        if not _has_ref(node):
            dfa = byte_dfa(node, self.budget)
            if (dfa.byte_table()[0, [ord("["), ord("{")]] >= 0).any():   # e.g. an enum value that is an array
                raise refused
            return dfa
        if isinstance(node, Ref):
            body = self.grammar.rules[node.name]
            if isinstance(body, Terminal):
                return body.dfa
            if node.name in seen or body is None:   # recursive: a structure
                raise refused
            return self.flat_dfa(body, path, (*seen, node.name))
        if not isinstance(node, Alternate):   # a sequence around a reference: an array or an object
            raise refused
        dfa = self.flat_dfa(node.options[0], path, seen)
        for option in node.options[1:]:
            dfa = union(dfa, self.flat_dfa(option, path, seen), self.budget)
        return dfa

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
                    raise Unsatisfiable(f"required property {name!r} at {path} does not satisfy propertyNames")
                continue
            try:
                element = self.element(self.property_schema(name, props, patterns, extra, path),
                                       f"{path}.properties.{name}")
            except Unsatisfiable:
                if name in required:
                    raise Unsatisfiable(f"required property {name!r} at {path} has no valid value") from None
                continue   # the property may not appear
            fields.append((Concat((value_literal(name), KEY_SEP, element)), name in required))
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
        if unknown := [k for k in names if k in ("oneOf", "$ref")]:
            raise SchemaError(f"{unknown[0]} inside propertyNames at {path} is not supported")
        names = self.merge_all_of(self.desugar(names, path), path)
        if "anyOf" in names:   # e.g. a negation: of its options, only those that admit strings matter
            rest = {k: v for k, v in names.items() if k != "anyOf"}
            options = []
            for option in names["anyOf"]:
                try:
                    options.append(_merge(rest, {} if option is True else option, path))
                except Unsatisfiable:
                    continue
            options = [o for o in options if o is not False and _may_be_string(o)]
            if len(options) > 1:
                raise SchemaError(f"anyOf inside propertyNames at {path} is not supported (with more than one "
                                  f"option for strings)")
            names = options[0] if options else {"type": "null"}
        if not _may_be_string(names):
            return _nothing()
        if "enum" in names or "const" in names:
            values = [names["const"]] if "const" in names else names["enum"]
            keys = [v for v in values if isinstance(v, str) and self.value_keywords_hold(v, names, path)]
            if not keys:
                return _nothing()
            return byte_dfa(Alternate(tuple(value_literal(k) for k in keys)))
        known = {"minLength", "maxLength", "pattern", "format", EXCLUDED_STRINGS}
        return self.string_dfa({k: v for k, v in names.items() if k in known}, path)

    def additional_pairs(self, declared, patterns, extra, name_dfa, path):
        """One pair of a property outside `declared`, or None when no such property may appear.

        A key's value must satisfy every patternProperties schema whose pattern the key matches
        (additionalProperties when it matches none), so the keys are split by the set of patterns
        they match: one key language per set (the intersection of those patterns and the
        complements of the others), the sets whose language is empty pruned as they are found."""
        key = json.dumps([declared, list(patterns), name_dfa is None])
        items = list(patterns.items())
        if key not in self.key_sets:   # the same object in several branches (if/then, anyOf) splits once
            self.key_sets[key] = self.split_keys(declared, [p for p, _ in items], name_dfa, path)
        options = []
        for matched, keys in self.key_sets[key]:
            value = extra if not matched else _both_all([items[k][1] for k in matched])
            where = f"{path}.additionalProperties" if not matched else f"{path}.patternProperties"
            try:
                element = self.element(value, where)
            except Unsatisfiable:   # keys of this set cannot appear (e.g. false, or types that clash)
                continue
            options.append(Concat((self.terminal("key", f"{key}/{matched}", lambda keys=keys: keys), KEY_SEP, element)))
        if not options:
            return None
        return self.rule("pair", options[0] if len(options) == 1 else Alternate(tuple(options)))

    def split_keys(self, declared, patterns, name_dfa, path) -> list[tuple[tuple[int, ...], DFA]]:
        """The keys outside `declared` split by the set of patterns they match: (the indexes of
        the patterns matched, the byte DFA of those keys) for each set with some key."""
        base = byte_dfa(Concat((QUOTE, Repeat(STRING_CHAR, 0, None), QUOTE)))
        if declared:
            base = intersect(base, complement(byte_dfa(Alternate(tuple(value_literal(n) for n in declared)))))
        if name_dfa is not None:
            base = intersect(base, name_dfa)
        dfas = [pattern_dfa(p, f"{path}.patternProperties") for p in patterns]
        out = []

        def split(i: int, keys, matched: tuple[int, ...]):
            self.budget.check_time()
            if not keys.accepting.any():
                return
            if i == len(dfas):
                out.append((matched, keys))
                return
            split(i + 1, intersect(keys, dfas[i], self.budget), (*matched, i))
            split(i + 1, intersect(keys, complement(dfas[i]), self.budget), matched)

        split(0, base, ())
        return out

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
            raise Unsatisfiable(f"no object satisfies the property counts and names at {path}")
        return body


# ---- helpers ---------------------------------------------------------------------------------


def _find_anchor(schema, name: str):
    """The subschema whose $anchor is `name` (or, before 2019-09, whose $id is "#name")."""
    if isinstance(schema, dict):
        if schema.get("$anchor") == name or schema.get("$id") == "#" + name:
            return schema
        children = schema.values()
    elif isinstance(schema, list):
        children = schema
    else:
        return None
    for child in children:
        if (found := _find_anchor(child, name)) is not None:
            return found
    return None


def _may_be_string(schema: dict) -> bool:
    """Whether the type and enum/const of `schema` leave room for a string."""
    types = schema.get("type", "string")
    values = [schema["const"]] if "const" in schema else schema.get("enum", [""])
    return "string" in ([types] if isinstance(types, str) else types) and any(isinstance(v, str) for v in values)


def _string_key(schema: dict) -> str:
    """The string keywords of `schema`, as a key: equal keys, equal string languages."""
    return json.dumps({k: schema.get(k) for k in ("minLength", "maxLength", "pattern", "format")}
                      | {"excluded": schema.get(EXCLUDED_STRINGS)}, sort_keys=True)


def _has_ref(node) -> bool:
    if isinstance(node, Ref):
        return True
    if isinstance(node, Concat):
        return any(_has_ref(p) for p in node.parts)
    if isinstance(node, Alternate):
        return any(_has_ref(o) for o in node.options)
    return isinstance(node, Repeat) and _has_ref(node.node)


def _has_none(node) -> bool:
    return isinstance(node, Concat) and any(p is None for p in node.parts)


@lru_cache(maxsize=1)
def _no_exponent():
    """Every byte string but a number written with an exponent."""
    return complement(byte_dfa(EXPONENT_NUMBER))


@lru_cache(maxsize=1)
def _nothing():
    """A DFA that accepts nothing: the complement of every byte string."""
    return complement(byte_dfa(Repeat(Chars(((0, 255),)), 0, None)))


def _sequence(elements: list, rest, lo: int, hi: int | None):
    """Array content: element i follows elements[i] (then `rest`; None: nothing more), lo..hi of them."""
    m = max(len(elements), lo)
    positions = elements + [rest] * (m - len(elements))
    if any(p is None for p in positions[:lo]):
        raise Unsatisfiable("minItems needs more items than the array allows")

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


MAX_MULTIPLE_STATES = 20_000


@lru_cache(maxsize=256)
def one_character_dfa():
    """One character of a JSON string's spelling: its start is state 0, its one accepting state has
    no moves (a character, once complete, is complete)."""
    return byte_dfa(STRING_CHAR)


@lru_cache(maxsize=256)
def string_length_dfa(lo: int, hi: int | None):
    """JSON strings (quotes included) of lo..hi characters, built as a chain of copies of the
    one-character DFA: far faster than determinizing lo..hi repeats (a maxLength of 100 is 100
    copies of a many-branched UTF-8 automaton)."""
    char = one_character_dfa()
    table = char.byte_table()                                                   # (C, 256)
    final = int(np.flatnonzero(char.accepting)[0])
    inner = np.array([s for s in range(char.num_states) if s != final])         # 0 (the start) first
    n = len(inner)
    slot = np.full(char.num_states + 1, -1, dtype=np.int64)
    slot[inner] = np.arange(n)
    local = table[inner]                                                        # (n, 256)
    within = np.where((local >= 0) & (local != final), slot[np.maximum(local, 0)], -1)   # moves inside a copy
    completes = local == final                                                  # moves that finish a character
    copies = (hi if hi is not None else lo) + 1                                 # characters counted 0..copies-1
    # states: 0 before the opening quote, 1 after the closing one, then copy k's state i at 2 + k*n + i
    big = np.full((2 + copies * n, 256), -1, dtype=np.int32)
    for k in range(copies):
        following = k + 1 if k + 1 < copies else (k if hi is None else None)  # unbounded: the last copy loops
        if following is None:   # maxLength reached: no character may start (it could never end)
            block = np.full_like(within, -1)
        else:
            block = np.where(completes, 2 + following * n, np.where(within >= 0, 2 + k * n + within, -1))
        if k >= lo:
            block[0, ord('"')] = 1
        big[2 + k * n:2 + (k + 1) * n] = block
    big[0, ord('"')] = 2
    accepting = np.zeros(len(big), dtype=bool)
    accepting[1] = True
    # Every state can still reach the closing quote, so the automaton is already trim; a chain of
    # copies is close to minimal, and Moore's refinement would take one round per copy.
    return DFA(np.arange(256, dtype=np.int64), big, accepting)


def multiple_of(schema: dict, path: str) -> tuple[int, int] | None:
    """multipleOf m as (P, k) with m = P / 10**k (None: absent, or 1 for integers' sake)."""
    if "multipleOf" not in schema:
        return None
    m = schema["multipleOf"]
    if isinstance(m, bool) or not isinstance(m, (int, float)) or m <= 0:
        raise SchemaError(f"multipleOf at {path} must be a number > 0")
    exact = Decimal(repr(m)) if isinstance(m, float) else Decimal(m)
    k = max(-exact.as_tuple().exponent, 0)
    whole = int(exact.scaleb(k))
    if whole * (k + 3) > MAX_MULTIPLE_STATES:
        raise SchemaError(f"multipleOf {m} at {path} is not supported: its automaton would need more than "
                          f"{MAX_MULTIPLE_STATES} states")
    return whole, k


def multiple_of_dfa(whole: int, k: int, fraction: bool):
    """Decimal numbers without exponent ("-"? no leading zeros) that are multiples of whole / 10**k;
    integers only unless `fraction`. x is one exactly when x * 10**k is an integer divisible by
    `whole`: the states follow that integer's residue as the digits come, and how many fraction
    digits have been read (past k, only zeros keep x * 10**k an integer)."""
    # state numbers: 0 start, 1 after "-", 2 the integer part "0", then per residue r:
    # int(r) = 3 + r, dot(r) = the "." just read, frac(r, c) = c fraction digits read (1..k)
    P, K = whole, max(k, 1)   # K: fraction states per residue (k = 0 keeps one, for "5.0")
    int_, dot = (lambda r: 3 + r), (lambda r: 3 + P + r)
    frac = lambda r, c: 3 + 2 * P + (c - 1) * P + r
    n = 3 + 2 * P + K * P
    table = np.full((n, 256), -1, dtype=np.int32)
    accepting = np.zeros(n, dtype=bool)
    digit = [ord("0") + d for d in range(10)]
    table[0, ord("-")] = 1
    for s in (0, 1):
        table[s, digit[0]] = 2
        for d in range(1, 10):
            table[s, digit[d]] = int_(d % P)
    accepting[2] = True
    if fraction:
        table[2, ord(".")] = dot(0)
    for r in range(P):
        for d in range(10):
            table[int_(r), digit[d]] = int_((10 * r + d) % P)
        accepting[int_(r)] = r * 10 ** k % P == 0
        if not fraction:
            continue
        table[int_(r), ord(".")] = dot(r)
        for d in range(10):
            if k:
                table[dot(r), digit[d]] = frac((10 * r + d) % P, 1)
        if not k:
            table[dot(r), digit[0]] = frac(r, 1)
        for c in range(1, K + 1):
            accepting[frac(r, c)] = r * 10 ** (k - c) % P == 0 if k else accepting[int_(r)]
            for d in range(10):
                if c < k:
                    table[frac(r, c), digit[d]] = frac((10 * r + d) % P, c + 1)
            table[frac(r, c), digit[0]] = frac(r, c) if c >= k else table[frac(r, c), digit[0]]
    return table_dfa(table, accepting)


def _annotation(key: str) -> bool:
    return key in ANNOTATIONS_OF_ALL_TYPES or key in ("title", "description", "default", "examples", "deprecated",
                                                       "readOnly", "writeOnly", "$defs", "definitions")


def _merge(a: dict, b: dict, path: str) -> dict:
    """Two schemas that must both hold, as one schema (exact merges only; SchemaError otherwise)."""
    a, b = _merge_positions(a, b, path)
    a, b = _close_properties(a, b, path), _close_properties(b, a, path)
    out = dict(a)
    for key, value in b.items():
        if key not in out or out[key] == value or _annotation(key):
            out.setdefault(key, value)
            continue
        mine = out[key]
        if key == "required":
            out[key] = list(dict.fromkeys([*mine, *value]))
        elif key == "properties":
            out[key] = {n: _both(mine.get(n, True), value.get(n, True)) for n in dict.fromkeys([*mine, *value])}
        elif key == "type":
            left = {mine} if isinstance(mine, str) else set(mine)
            right = {value} if isinstance(value, str) else set(value)
            both = (left & right) | ({"integer"} if "integer" in left | right and "number" in left | right else set())
            if not both:
                raise Unsatisfiable(f"allOf at {path}: the types {mine!r} and {value!r} have nothing in common")
            out[key] = sorted(both)
        elif key in ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties", "minContains"):
            out[key] = max(mine, value)
        elif key in ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties", "maxContains"):
            out[key] = min(mine, value)
        elif key == "enum":
            out[key] = [v for v in mine if any(_json_equal(v, w) for w in value)]
        elif key == "const":
            if not _json_equal(mine, value):
                raise Unsatisfiable(f"allOf at {path}: the consts {mine!r} and {value!r} differ")
        elif key == "multipleOf":
            x, y = Fraction(str(mine)), Fraction(str(value))
            step = Fraction(math.lcm(x.numerator, y.numerator), math.gcd(x.denominator, y.denominator))
            out[key] = int(step) if step.denominator == 1 else float(step)
        elif key in ("anyOf", "oneOf"):
            out[key] = [{"allOf": [x, y]} for x in mine for y in value]
        elif key in ("additionalProperties", "propertyNames", "items"):   # not contains: two contains are not one
            out[key] = _both(mine, value)
        elif key in (EXCLUDED_STRINGS, EXCLUDED_NUMBERS):
            out[key] = [*mine, *(v for v in value if v not in mine)]
        else:
            raise SchemaError(f"allOf at {path}: {key!r} differs between the schemas and cannot be merged")
    return out


def _both(x, y):
    """The schema of what satisfies both x and y."""
    if x is False or y is False:
        return False
    return y if x is True else x if y is True else {"allOf": [x, y]}


def _both_all(schemas: list):
    out = True
    for x in schemas:
        out = _both(out, x)
    return out


def _close_properties(side: dict, other: dict, path: str) -> dict:
    """`other` with the properties it declares and `side` does not made to satisfy side's
    additionalProperties: for `side` they are additional properties."""
    extra = side.get("additionalProperties", True)
    if extra is True:
        return other
    if other.get("patternProperties", {}) not in ({}, side.get("patternProperties", {})):
        raise SchemaError(f"allOf at {path}: patternProperties beside additionalProperties in another branch "
                          f"cannot be merged")

    def additional(name: str) -> bool:
        key = json.dumps(name, ensure_ascii=False).encode()
        return name not in side.get("properties", {}) and not any(
            pattern_dfa(p, f"{path}.patternProperties").fullmatch(key) for p in side.get("patternProperties", {}))
    props = {n: _both(v, extra) if additional(n) else v for n, v in other.get("properties", {}).items()}
    return {**other, "properties": props} if props else other


def _positions(schema: dict) -> tuple[list, object] | None:
    """An array schema's (per-position schemas, schema of the rest), or None without such keywords."""
    if isinstance(schema.get("items"), list):                    # draft-07
        return list(schema["items"]), schema.get("additionalItems", True)
    if "prefixItems" in schema or "items" in schema:
        return list(schema.get("prefixItems", [])), schema.get("items", True)
    return None


def _merge_positions(a: dict, b: dict, path: str) -> tuple[dict, dict]:
    """prefixItems/items of both branches as one list: position i must satisfy both branches' schema
    for position i (a branch's rest schema where its own list is shorter)."""
    pa, pb = _positions(a), _positions(b)
    if pa is None or pb is None or pa == pb:
        return a, b
    if "additionalItems" in a or "additionalItems" in b:
        raise SchemaError(f"allOf at {path}: items/additionalItems in several branches cannot be merged")
    n = max(len(pa[0]), len(pb[0]))
    at = lambda p, i: p[0][i] if i < len(p[0]) else p[1]
    merged = {"prefixItems": [_both(at(pa, i), at(pb, i)) for i in range(n)], "items": _both(pa[1], pb[1])}
    strip = lambda s: {k: v for k, v in s.items() if k not in ("prefixItems", "items", "additionalItems")}
    return {**strip(a), **merged}, strip(b)


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
    if value is not None and value > MAX_REPEAT:   # counted in states: past it, the automaton outgrows a request
        raise SchemaError(f"{key} at {path} is {value}: at most {MAX_REPEAT} is supported")
    return value


def _bound(schema: dict, key: str, path: str):
    """A numeric bound (None when absent)."""
    value = schema.get(key)
    if value is None or isinstance(value, bool):
        return None
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SchemaError(f"{key} at {path} must be a finite number, got {value!r}")
    if abs(value) >= MAX_BOUND:  # the digit-by-digit range automaton grows with the digits
        raise SchemaError(f"{key} at {path} is {value!r}: bounds below {MAX_BOUND:g} in magnitude are supported")
    return value


def _decimal(value) -> Decimal:
    """A JSON number as the decimal it is written as (a float by its shortest repr)."""
    return Decimal(repr(value)) if isinstance(value, float) else Decimal(value)


def _number_keywords_hold(x: Decimal, schema: dict, path: str) -> bool:
    """Whether the number x satisfies schema's bounds, multipleOf and EXCLUDED_NUMBERS."""
    checks = {"minimum": lambda b: x >= b, "maximum": lambda b: x <= b,
              "exclusiveMinimum": lambda b: x > b, "exclusiveMaximum": lambda b: x < b}
    for key, holds in checks.items():
        if (bound := _bound(schema, key, path)) is not None and not holds(_decimal(bound)):
            return False
    if multiple_of(schema, path) is not None and Fraction(x) % Fraction(_decimal(schema["multipleOf"])) != 0:
        return False
    for entry in schema.get(EXCLUDED_NUMBERS, []):
        if "enum" in entry and any(x == _decimal(v) for v in entry["enum"]) or \
                multiple_of(entry, path) is not None and Fraction(x) % Fraction(_decimal(entry["multipleOf"])) == 0 or \
                entry.get("type") == "integer" and x == x.to_integral_value():
            return False
    return True


def _is_type(value, kind: str) -> bool:
    return {"string": isinstance(value, str), "boolean": isinstance(value, bool), "null": value is None,
            "integer": isinstance(value, int) and not isinstance(value, bool) or
            isinstance(value, float) and value.is_integer(),
            "number": isinstance(value, (int, float)) and not isinstance(value, bool),
            "array": isinstance(value, list), "object": isinstance(value, dict)}.get(kind, False)
