"""JSON Schema -> a regular expression over the JSON text of the instances it accepts.

The subset people use for tool arguments and structured answers:

    type            "object" "array" "string" "integer" "number" "boolean" "null", or a list of them
    object          properties (written in the schema's order), required; additionalProperties
                    absent or false (no other property is ever generated)
    string          enum, const, pattern (anchored ^...$), minLength, maxLength
    integer         minimum, maximum, exclusiveMinimum, exclusiveMaximum (exact, any bounds)
    number          minimum 0 (no minus sign); other bounds are not regular enough and are refused
    array           items, minItems, maxItems
    combinators     anyOf, enum, const, $ref to #/$defs/... (or #/definitions/...), not recursive

Whitespace policy: the one layout of ``json.dumps`` - ``", "`` between items, ``": "`` after a key,
no newlines - so a generated instance is one line and every separator is forced (jump-forward
writes them without the model). Integers are written without a fraction or exponent; strings
escape ``"``, ``\\`` and control characters, and may hold any other character as itself.

Any other keyword raises ``SchemaError`` naming it and where it sits (``$.properties.when``):
an unsupported constraint is refused, never silently dropped. Annotations (title, description,
default, examples ...) are ignored, as validators ignore them. So is a value the engine cannot
honour: a length or item count above MAX_REPEAT, a bound that is no finite number, a pattern no
string matches.

The regex grows as the walk writes it - doubling per level of nested arrays, once per path
through a ``$ref`` chain - so each piece is counted against the compile budget (``regex_length``,
budget.py) as it is written, and so is the nesting of schemas: a kilobyte of schema asking for
megabytes of regex is refused after writing at most about the bound.
"""
from __future__ import annotations

import json
import math
from decimal import Decimal

from minillm.generation.constrained.budget import CompileBudget
from minillm.generation.constrained.regex import MAX_REPEAT, RegexError, escape, parse

ANNOTATIONS = {"title", "description", "$schema", "$id", "$comment", "default", "examples", "deprecated",
               "readOnly", "writeOnly"}
SUPPORTED = {"type", "enum", "const", "properties", "required", "additionalProperties", "items", "minItems",
             "maxItems", "minLength", "maxLength", "pattern", "minimum", "maximum", "exclusiveMinimum",
             "exclusiveMaximum", "anyOf", "$ref", "$defs", "definitions"}
MAX_BOUND = 1e100  # minimum, maximum ... of an integer: below this in magnitude
GENERIC_DEPTH = 2  # "any JSON" (a bare {"type": "object"}, json_object mode) nests at most this deep

ITEM_SEP, KEY_SEP = ", ", ": "
STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
STRING = f'"{STRING_CHAR}*"'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
FRACTION_EXPONENT = r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
NUMBER = INTEGER + FRACTION_EXPONENT
BOOLEAN, NULL = "(?:true|false)", "null"


class SchemaError(ValueError):
    """The schema uses something outside the supported subset, or is malformed."""


def draft4_bounds(schema: dict) -> dict:
    """Draft-04's boolean exclusiveMinimum/Maximum (true: minimum/maximum is exclusive) in 2020-12 terms."""
    out = dict(schema)
    for bound, flag in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if isinstance(out.get(flag), bool):
            if out.pop(flag) and bound in out:
                out[flag] = out.pop(bound)
    return out


def schema_to_regex(schema: dict | bool | str, budget: CompileBudget | None = None) -> str:
    """The regex whose matches are exactly the JSON texts (in the layout above) of `schema`'s instances,
    written within `budget` (``ConstraintTooLarge`` past it)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (json.JSONDecodeError, RecursionError) as e:
            raise SchemaError(f"the schema is not valid JSON: {e}") from None
    return _Compiler(schema, CompileBudget() if budget is None else budget).compile(schema, "$", ())


def json_value_regex(depth: int = GENERIC_DEPTH) -> str:
    """Any JSON value whose arrays and objects nest at most `depth` deep."""
    scalar = f"(?:{STRING}|{NUMBER}|{BOOLEAN}|{NULL})"
    value = scalar
    for _ in range(depth):
        value = f"(?:{scalar}|{_array(value, 0, None)}|{_object_any(value)})"
    return value


def json_object_regex(depth: int = GENERIC_DEPTH) -> str:
    """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``), nesting bounded."""
    return _object_any(json_value_regex(depth - 1))


def _object_any(value: str) -> str:
    pair = f"{STRING}{KEY_SEP}{value}"
    return rf"\{{(?:{pair}(?:{ITEM_SEP}{pair})*)?\}}"


def _array(item: str, lo: int, hi: int | None) -> str:
    if hi == 0:
        return r"\[\]"
    more = f"(?:{ITEM_SEP}{item})" + ("*" if hi is None and lo <= 1 else "{%d,%s}" % (max(lo - 1, 0), "" if hi is None else hi - 1))
    body = f"{item}{more}"
    return rf"\[{body}\]" if lo >= 1 else rf"\[(?:{body})?\]"


def _literal(value) -> str:
    return escape(json.dumps(value, ensure_ascii=False))


# -----------------------------------------------------------------------------------------------
# Integer ranges as regexes


def decimal_digits(value: Decimal) -> tuple[int, str]:
    """A non-negative decimal as (integer part, fraction digits without trailing zeros)."""
    whole = int(value)
    fraction = format(value - whole, "f")[2:].rstrip("0") if value != whole else ""
    return whole, fraction


def number_spellings(value) -> str:
    """A regex of every spelling without exponent of the number `value` (an int, a float by its
    shortest repr, a Decimal): trailing zeros after the point, and "-0" for zero."""
    exact = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
    whole, fraction = decimal_digits(abs(exact))
    sign = "-?" if exact == 0 else "-" if exact < 0 else ""
    return f"{sign}{whole}" + (rf"\.{fraction}0*" if fraction else r"(?:\.0+)?")


def integer_range_regex(lo: int | None, hi: int | None) -> str:
    """Decimal integers (no leading zeros, "-" for negatives) in [lo, hi]; None is unbounded."""
    options = []
    if hi is None or hi >= 0:                                   # 0 and up
        options += _nonnegative(max(lo, 0) if lo is not None else 0, hi)
    if lo is None or lo < 0:                                    # below 0: "-" and the magnitude
        options += ["-" + o for o in _nonnegative(max(-hi, 1) if hi is not None else 1, None if lo is None else -lo)]
    if not options:
        raise SchemaError(f"no integer lies in [{lo}, {hi}]")
    return "(?:" + "|".join(options) + ")"


def _nonnegative(lo: int, hi: int | None) -> list[str]:
    if hi is not None and lo > hi:
        return []
    top = hi if hi is not None else 10 ** len(str(lo)) - 1
    out = []
    for digits in range(len(str(lo)), len(str(top)) + 1):       # one digit count at a time
        a, b = max(lo, 10 ** (digits - 1) if digits > 1 else 0), min(top, 10 ** digits - 1)
        if a <= b:
            out += _same_length(str(a), str(b))
    if hi is None:                                              # every longer number
        out.append(f"[1-9][0-9]{{{len(str(lo))},}}")
    return out


def _same_length(a: str, b: str) -> list[str]:
    """Digit strings of one length from a to b (inclusive), as alternatives."""
    if a == b:
        return [a]
    if len(a) == 1:
        return [f"[{a}-{b}]"]
    if a[0] == b[0]:
        return [a[0] + rest for rest in _same_length(a[1:], b[1:])]
    n = len(a) - 1
    out, first, last = [], int(a[0]), int(b[0])
    if a[1:] != "0" * n:        # a's own leading digit covers only a[1:] .. 99..9
        out += [a[0] + rest for rest in _same_length(a[1:], "9" * n)]
        first += 1
    if b[1:] != "9" * n:        # so does b's: 00..0 .. b[1:]
        last -= 1
    if first <= last:           # the leading digits in between take any tail
        out.append((str(first) if first == last else f"[{first}-{last}]") + f"[0-9]{{{n}}}")
    if b[1:] != "9" * n:
        out += [b[0] + rest for rest in _same_length("0" * n, b[1:])]
    return out


# -----------------------------------------------------------------------------------------------
# The schema walk


class _Compiler:
    def __init__(self, root, budget: CompileBudget):
        self.root, self.budget, self.depth = root, budget, 0
        self.by_ref: dict[str, str] = {}   # each $ref target written once: a chain of them may reach it 2^n ways

    def compile(self, schema, path: str, refs: tuple[str, ...]) -> str:
        """The regex of the schema at `path`, counted against the budget once written."""
        self.depth += 1
        self.budget.count("nesting_depth", self.depth, f"the schema at {path}")
        regex = self.written(schema, path, refs)
        self.depth -= 1
        self.budget.count("regex_length", len(regex), f"the schema at {path}")
        return regex

    def written(self, schema, path: str, refs: tuple[str, ...]) -> str:
        if schema is True or schema == {}:
            return json_value_regex()
        if schema is False:
            raise SchemaError(f"the schema at {path} is false: no instance is valid")
        if not isinstance(schema, dict):
            raise SchemaError(f"the schema at {path} must be an object or a boolean, got {type(schema).__name__}")
        for key in schema:
            if key not in SUPPORTED and key not in ANNOTATIONS:
                raise SchemaError(f"unsupported JSON Schema keyword {key!r} at {path}")
        rules = {k: v for k, v in schema.items() if k not in ANNOTATIONS and k not in ("$defs", "definitions")}
        if "$ref" in rules:
            self._alone(rules, "$ref", path)
            return self.reference(rules["$ref"], path, refs)
        if "anyOf" in rules:
            self._alone(rules, "anyOf", path)
            options = rules["anyOf"]
            if not isinstance(options, list) or not options:
                raise SchemaError(f"anyOf at {path} must be a non-empty list")
            return "(?:" + "|".join(self.compile(s, f"{path}.anyOf[{i}]", refs) for i, s in enumerate(options)) + ")"
        if "enum" in rules or "const" in rules:
            return self.enumeration(rules, path)
        types = rules.get("type", ["object", "array", "string", "integer", "number", "boolean", "null"])
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or not types:
            raise SchemaError(f"type at {path} must be a type name or a non-empty list of them")
        if "type" not in rules and len(rules) == 0:
            return json_value_regex()
        if "integer" in types and "number" in types:
            types = [t for t in types if t != "integer"]   # every integer is a number
        return "(?:" + "|".join(self.typed(t, rules, path, refs) for t in types) + ")"

    @staticmethod
    def _alone(rules: dict, keyword: str, path: str) -> None:
        others = sorted(set(rules) - {keyword})
        if others:
            raise SchemaError(f"{keyword} at {path} beside {', '.join(map(repr, others))} is not supported: "
                              f"move those keywords into the {keyword} target")

    def reference(self, ref, path: str, refs: tuple[str, ...]) -> str:
        if not isinstance(ref, str) or not ref.startswith(("#/$defs/", "#/definitions/")):
            raise SchemaError(f"$ref {ref!r} at {path}: only local references to #/$defs/... are supported")
        if ref in refs:
            raise SchemaError(f"$ref {ref!r} at {path} is recursive: a recursive schema is not regular")
        section, name = ref[2:].split("/", 1)
        target = self.root.get(section, {}).get(name) if isinstance(self.root, dict) else None
        if target is None:
            raise SchemaError(f"$ref {ref!r} at {path} points at nothing")
        if ref not in self.by_ref:
            self.by_ref[ref] = self.compile(target, ref, (*refs, ref))
        return self.by_ref[ref]

    def enumeration(self, rules: dict, path: str) -> str:
        extra = sorted(set(rules) - {"enum", "const", "type"})
        if extra:
            raise SchemaError(f"enum/const at {path} beside {', '.join(map(repr, extra))} is not supported")
        values = [rules["const"]] if "const" in rules else rules["enum"]
        if not isinstance(values, list) or not values:
            raise SchemaError(f"enum at {path} must be a non-empty list")
        if "type" in rules:
            types = rules["type"] if isinstance(rules["type"], list) else [rules["type"]]
            values = [v for v in values if any(_is_type(v, t) for t in types)]
            if not values:
                raise SchemaError(f"no value of enum at {path} has type {rules['type']!r}")
        return "(?:" + "|".join(_literal(v) for v in values) + ")"

    def typed(self, kind: str, rules: dict, path: str, refs: tuple[str, ...]) -> str:
        if kind == "string":
            return self.string(rules, path)
        if kind == "integer":
            return self.integer(rules, path)
        if kind == "number":
            return self.number(rules, path)
        if kind == "boolean":
            return BOOLEAN
        if kind == "null":
            return NULL
        if kind == "array":
            return self.array(rules, path, refs)
        if kind == "object":
            return self.object(rules, path, refs)
        raise SchemaError(f"unknown type {kind!r} at {path}")

    def string(self, rules: dict, path: str) -> str:
        lo, hi = _count(rules, "minLength", path), _count(rules, "maxLength", path, None)
        if "pattern" in rules:
            pattern = rules["pattern"]
            if not (isinstance(pattern, str) and pattern.startswith("^") and pattern.endswith("$")):
                raise SchemaError(f"pattern at {path} must be anchored (^...$): an unanchored pattern lets any "
                                  f"text surround its match")
            if "minLength" in rules or "maxLength" in rules:
                raise SchemaError(f"pattern at {path} beside minLength/maxLength is not supported")
            inner = pattern[1:-1]
            try:
                parse(inner, self.budget)
            except RegexError as e:
                raise SchemaError(f"pattern at {path}: {e}") from None
            return f'"(?:{inner})"'
        if hi is not None and hi < lo:
            raise SchemaError(f"maxLength < minLength at {path}")
        count = "*" if lo == 0 and hi is None else "{%d,%s}" % (lo, "" if hi is None else hi)
        return f'"{STRING_CHAR}{count}"'

    def integer(self, rules: dict, path: str) -> str:
        lo, hi = None, None
        for key, bound in (("minimum", lambda x: math.ceil(x)), ("exclusiveMinimum", lambda x: math.floor(x) + 1)):
            if key in rules:
                value = bound(_number(rules, key, path))
                lo = value if lo is None else max(lo, value)
        for key, bound in (("maximum", lambda x: math.floor(x)), ("exclusiveMaximum", lambda x: math.ceil(x) - 1)):
            if key in rules:
                value = bound(_number(rules, key, path))
                hi = value if hi is None else min(hi, value)
        if lo is None and hi is None:
            return INTEGER
        if lo is not None and hi is not None and lo > hi:
            raise SchemaError(f"no integer lies within the bounds at {path}")
        return integer_range_regex(lo, hi)

    def number(self, rules: dict, path: str) -> str:
        bounds = sorted({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"} & set(rules))
        if bounds == ["minimum"] and _number(rules, "minimum", path) == 0:
            return r"(?:0|[1-9][0-9]*)" + FRACTION_EXPONENT
        if bounds:
            raise SchemaError(f"{bounds[0]} on a number at {path} is not supported (only minimum 0); "
                              f"bound an integer instead")
        return NUMBER

    def array(self, rules: dict, path: str, refs: tuple[str, ...]) -> str:
        if "items" not in rules:
            raise SchemaError(f"an array at {path} needs 'items': its elements must have a schema")
        item = self.compile(rules["items"], f"{path}.items", refs)
        lo, hi = _count(rules, "minItems", path), _count(rules, "maxItems", path, None)
        if hi is not None and hi < lo:
            raise SchemaError(f"maxItems < minItems at {path}")
        return _array(f"(?:{item})", lo, hi)

    def object(self, rules: dict, path: str, refs: tuple[str, ...]) -> str:
        extra = rules.get("additionalProperties", None)
        props = rules.get("properties", {})
        if not isinstance(props, dict):
            raise SchemaError(f"properties at {path} must be an object")
        if extra not in (None, False):
            raise SchemaError(f"additionalProperties at {path} must be false or absent: only the listed "
                              f"properties can be generated")
        if not props and extra is None:
            return json_object_regex()
        required = rules.get("required", [])
        if not isinstance(required, list) or any(r not in props for r in required):
            raise SchemaError(f"required at {path} must list names from its properties")
        fields = [(f"{_literal(name)}{KEY_SEP}(?:{self.compile(s, f'{path}.properties.{name}', refs)})",
                   name in required) for name, s in props.items()]
        return r"\{" + self.members(fields, path) + r"\}"

    def members(self, fields: list[tuple[str, bool]], path: str) -> str:
        """Properties in order, optional ones skippable, with ", " exactly between the present ones.

        after[i]: the rest from field i when something is already written (each field needs ", ");
        first[i]: the rest from field i when nothing is written yet. `after` grows linearly: an
        optional field is "(, f)?" in it. `first` holds "f after[i+1] | first[i+1]", so it grows
        with the square of the optional fields: counted as it grows."""
        after, first = "", ""
        for text, required in reversed(fields):
            if required:
                first = f"{text}{after}"
                after = f"{ITEM_SEP}{text}{after}"
            else:
                first = f"(?:{text}{after}|{first})" if first else f"(?:{text}{after})?"
                after = f"(?:{ITEM_SEP}{text})?{after}"
            self.budget.count("regex_length", len(first), f"the properties at {path}")
        return first


def _count(rules: dict, key: str, path: str, default: int | None = 0) -> int | None:
    """A length or item count: an integer in [0, MAX_REPEAT] (the regex repeats its element that
    many times; past it, the automaton grows beyond what a request may ask for)."""
    value = rules.get(key, default)
    if value is not default and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        raise SchemaError(f"{key} at {path} must be an integer >= 0, got {value!r}")
    if value is not None and value > MAX_REPEAT:
        raise SchemaError(f"{key} at {path} is {value}: at most {MAX_REPEAT} is supported")
    return value


def _number(rules: dict, key: str, path: str) -> float:
    value = rules[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SchemaError(f"{key} at {path} must be a finite number, got {value!r}")
    if abs(value) >= MAX_BOUND:  # the digit-by-digit range regex grows with the square of the digits
        raise SchemaError(f"{key} at {path} is {value!r}: bounds below {MAX_BOUND:g} in magnitude are supported")
    return value


def _is_type(value, kind: str) -> bool:
    return {"string": isinstance(value, str), "boolean": isinstance(value, bool), "null": value is None,
            "integer": isinstance(value, int) and not isinstance(value, bool),
            "number": isinstance(value, (int, float)) and not isinstance(value, bool),
            "array": isinstance(value, list), "object": isinstance(value, dict)}.get(kind, False)
