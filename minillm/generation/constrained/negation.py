"""``not``: the complement of a schema, written as a schema the grammar compiler can build.

A grammar has no complement, but a schema's failures can be listed keyword by keyword: an instance
fails ``S`` exactly when it fails one of S's keywords, and each keyword constrains one type only,
so its failures are instances *of that type* that break it (``minLength: 3`` fails on strings of
at most 2 characters and on nothing else). ``negate(S)`` is the ``anyOf`` of those failures:

    type: T                    the other types (integer: also numbers with a fraction)
    enum / const               each type with no listed value; for strings and numbers, the values
                               of that type outside the list; the booleans not listed
    minLength n                {type: string, maxLength: n-1}       (and so on for every count/bound)
    pattern, format            {type: string} minus the pattern's / format's strings
    multipleOf m               {type: number} minus the multiples of m
    required [k...]            an object without k, for some k
    properties {k: P}          an object whose k satisfies not P
    items X                    an array that contains not X
    contains X                 an array whose items all satisfy not X
    allOf / anyOf / oneOf      De Morgan (oneOf fails also where two options hold)
    not X                      X
    if/then/else               (if and not then) or (not if and not else)
    $ref                       not of its target
    true / {} / false          false / true

What cannot be listed that way is refused with ``SchemaError`` naming the keyword and its path:
additionalProperties, patternProperties and propertyNames (their failure is "some other key..."),
prefixItems and draft-07's items arrays, min/maxContains, uniqueItems, the dependencies and
unevaluated* keywords, a $ref that leads back into the ``not`` being negated, an enum value that
is an array or an object.

Two failures have no keyword of their own: strings outside a regular language and numbers outside
a set of numbers. They are two keywords of the compiler's own, ``EXCLUDED_STRINGS`` and
``EXCLUDED_NUMBERS`` (keys that are no strings, so no schema written in JSON can hold them), each a
list of one-keyword schemas whose instances are left out; json_grammar.py subtracts their automata.
The numbers left out are subtracted from the numbers written without an exponent, so a negated
number keyword produces no exponent (a subset, as for bounded numbers).
"""
from __future__ import annotations

from minillm.generation.constrained.json_schema import SchemaError, draft4_bounds

TYPES = ("object", "array", "string", "number", "boolean", "null")   # integer is a kind of number
SKIPPED = {"$defs", "definitions", "then", "else", "minContains", "maxContains", "additionalItems"}
UNNEGATABLE = {
    "additionalProperties": "its failure is an extra key with a failing value",
    "patternProperties": "its failure is a matching key with a failing value",
    "propertyNames": "its failure is some key outside a language",
    "prefixItems": "its failure is an item at one position",
    "uniqueItems": "its failure is a repeated item",
    "dependentRequired": "dependencies between properties are not supported",
    "dependentSchemas": "dependencies between properties are not supported",
    "dependencies": "dependencies between properties are not supported",
    "unevaluatedProperties": "unevaluated* keywords are not supported",
    "unevaluatedItems": "unevaluated* keywords are not supported",
    "$dynamicRef": "dynamic references are not supported", "$recursiveRef": "dynamic references are not supported",
}


HANDLERS = {k: "_not_" + k.lstrip("$") for k in (
    "allOf", "anyOf", "oneOf", "not", "if", "$ref", "type", "const", "enum", "minLength", "maxLength", "pattern",
    "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minItems", "maxItems",
    "minProperties", "maxProperties", "required", "properties", "items", "contains")}


class _OwnKeyword:
    """A keyword of the compiler's own: not a string, so never a key of a schema parsed from JSON."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


EXCLUDED_STRINGS = _OwnKeyword("<excluded strings>")   # [{"pattern": p} | {"format": f} | {"enum": [str...]}]
EXCLUDED_NUMBERS = _OwnKeyword("<excluded numbers>")   # [{"enum": [num...]} | {"multipleOf": m} | {"type": "integer"}]


def any_of(options: list):
    """The schema of what satisfies one of `options` (true and false folded in)."""
    options = [o for o in options if o is not False]
    if any(o is True for o in options):
        return True
    return False if not options else options[0] if len(options) == 1 else {"anyOf": options}


def all_of(parts: list):
    """The schema of what satisfies all of `parts`."""
    if any(p is False for p in parts):
        return False
    parts = [p for p in parts if p is not True]
    return True if not parts else parts[0] if len(parts) == 1 else {"allOf": parts}


class Negator:
    """negate(schema) for one document: `resolve` finds a $ref's target; draft-07's $ref overrides
    the keywords beside it when `ref_overrides`; a format outside `formats` asserts nothing."""

    def __init__(self, resolve, ref_overrides: bool, formats):
        self.resolve, self.ref_overrides, self.formats = resolve, ref_overrides, formats   # formats: the known names
        self.open_refs: list[str] = []   # the $refs being negated: meeting one again would never end

    def negate(self, schema, path: str, keyword: str = "not"):
        """The schema of the instances `schema` rejects - the value of `keyword` (``not`` or ``if``) in
        the schema at `path`; SchemaError naming the keyword and the part that cannot be negated."""
        try:
            return self._negate(schema, f"{path}.{keyword}")
        except _Refusal as e:
            raise SchemaError(f"{keyword} at {path} is not supported: {e}") from None

    def _negate(self, schema, path: str):
        if schema is True:
            return False
        if schema is False:
            return True
        if not isinstance(schema, dict):
            raise SchemaError(f"the schema at {path} must be an object or a boolean, got {type(schema).__name__}")
        if "$ref" in schema and self.ref_overrides:
            return self._reference(schema["$ref"], path)
        schema = draft4_bounds(schema)
        failures = []
        for key, value in schema.items():
            if key in SKIPPED:
                continue
            if key in UNNEGATABLE:
                if _trivial(key, value):
                    continue
                raise _Refusal(f"{key} at {path}.{key} cannot be negated ({UNNEGATABLE[key]})")
            handler = HANDLERS.get(key)   # None: an annotation or a keyword unknown to JSON Schema
            if handler is not None:
                failures.append(getattr(self, handler)(value, schema, f"{path}.{key}"))
        return any_of(failures)

    # ---- combinators ----------------------------------------------------------------------

    def _not_allOf(self, parts, schema, path):
        return any_of([self._negate(p, f"{path}[{i}]") for i, p in enumerate(_list(parts, path))])

    def _not_anyOf(self, options, schema, path):
        return all_of([self._negate(o, f"{path}[{i}]") for i, o in enumerate(_list(options, path))])

    def _not_oneOf(self, options, schema, path):
        options = _list(options, path)
        two = [all_of([options[i], options[j]]) for i in range(len(options)) for j in range(i + 1, len(options))]
        return any_of([self._not_anyOf(options, schema, path), *two])

    def _not_not(self, inner, schema, path):
        return inner

    def _not_if(self, condition, schema, path):
        then, other = schema.get("then", True), schema.get("else", True)
        if then is True and other is True:
            return False
        where = path[:-len(".if")]
        return any_of([all_of([condition, self._negate(then, f"{where}.then")]),
                       all_of([self._negate(condition, path), self._negate(other, f"{where}.else")])])

    def _not_ref(self, ref, schema, path):
        return self._reference(ref, path)

    def _reference(self, ref, path):
        if ref in self.open_refs:
            raise _Refusal(f"$ref {ref!r} at {path} leads back into the schema being negated")
        self.open_refs.append(ref)
        try:
            return self._negate(self.resolve(ref, path), ref)
        finally:
            self.open_refs.pop()

    # ---- values -----------------------------------------------------------------------------

    def _not_type(self, types, schema, path):
        names = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else None
        if not names or not names <= {*TYPES, "integer"}:
            raise SchemaError(f"type at {path} must be one of {', '.join(TYPES)}, integer or a non-empty list of them")
        others = [t for t in TYPES if t not in names]
        options = [{"type": others}] if others else []
        if "integer" in names and "number" not in names:   # 'number' is among `others` then: only fractions fail
            options = [{"type": [t for t in others if t != "number"]}] if len(others) > 1 else []
            options.append({"type": "number", EXCLUDED_NUMBERS: [{"type": "integer"}]})
        return any_of(options)

    def _not_const(self, value, schema, path):
        return self._not_enum([value], schema, path)

    def _not_enum(self, values, schema, path):
        if not isinstance(values, list):
            raise SchemaError(f"enum at {path} must be a list")
        if any(isinstance(v, (list, dict)) for v in values):
            raise _Refusal(f"{path} holds an array or an object: their complement is not supported")
        strings = [v for v in values if isinstance(v, str)]
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        booleans = [b for b in (True, False) if not any(v is b for v in values)]
        options = [{"type": [t for t in ("object", "array") + (() if None in values else ("null",))]}]
        options.append({"type": "string", EXCLUDED_STRINGS: [{"enum": strings}]} if strings else {"type": "string"})
        options.append({"type": "number", EXCLUDED_NUMBERS: [{"enum": numbers}]} if numbers else {"type": "number"})
        if booleans:
            options.append({"enum": booleans})
        return any_of(options)

    # ---- strings, numbers ---------------------------------------------------------------------

    def _not_minLength(self, n, schema, path):
        return {"type": "string", "maxLength": n - 1} if n > 0 else False

    def _not_maxLength(self, n, schema, path):
        return {"type": "string", "minLength": n + 1}

    def _not_pattern(self, pattern, schema, path):
        return {"type": "string", EXCLUDED_STRINGS: [{"pattern": pattern}]}

    def _not_format(self, name, schema, path):
        return {"type": "string", EXCLUDED_STRINGS: [{"format": name}]} if name in self.formats else False

    def _not_minimum(self, bound, schema, path):
        return {"type": "number", "exclusiveMaximum": bound}

    def _not_maximum(self, bound, schema, path):
        return {"type": "number", "exclusiveMinimum": bound}

    def _not_exclusiveMinimum(self, bound, schema, path):
        return {"type": "number", "maximum": bound}

    def _not_exclusiveMaximum(self, bound, schema, path):
        return {"type": "number", "minimum": bound}

    def _not_multipleOf(self, step, schema, path):
        return {"type": "number", EXCLUDED_NUMBERS: [{"multipleOf": step}]}

    # ---- arrays, objects ----------------------------------------------------------------------

    def _not_minItems(self, n, schema, path):
        return {"type": "array", "maxItems": n - 1} if n > 0 else False

    def _not_maxItems(self, n, schema, path):
        return {"type": "array", "minItems": n + 1}

    def _not_minProperties(self, n, schema, path):
        return {"type": "object", "maxProperties": n - 1} if n > 0 else False

    def _not_maxProperties(self, n, schema, path):
        return {"type": "object", "minProperties": n + 1}

    def _not_required(self, names, schema, path):
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise SchemaError(f"required at {path} must be a list of names")
        return any_of([{"type": "object", "properties": {n: False}} for n in names])

    def _not_properties(self, props, schema, path):
        if not isinstance(props, dict):
            raise SchemaError(f"properties at {path} must be an object")
        return any_of([_object_with(name, self._negate(sub, f"{path}.{name}")) for name, sub in props.items()])

    def _not_items(self, items, schema, path):
        if isinstance(items, list) or "prefixItems" in schema and schema["prefixItems"]:
            raise _Refusal(f"items at {path} after positional items cannot be negated (its failure is an item "
                           f"at one position)")
        failing = self._negate(items, path)
        return False if failing is False else {"type": "array", "contains": failing}

    def _not_contains(self, contains, schema, path):
        if "minContains" in schema or "maxContains" in schema:
            raise _Refusal(f"contains at {path} with minContains/maxContains cannot be negated")
        return {"type": "array", "items": self._negate(contains, path)}


class _Refusal(Exception):
    """A part of the negated schema that has no complement we can write (the message says which)."""


def _object_with(name: str, value):
    return False if value is False else {"type": "object", "required": [name], "properties": {name: value}}


def _list(value, path: str) -> list:
    if not isinstance(value, list) or not value:
        raise SchemaError(f"{path} must be a non-empty list")
    return value


def _trivial(key: str, value) -> bool:
    """A keyword that rejects nothing, so its negation adds nothing."""
    if key == "uniqueItems":
        return value is False
    if key == "prefixItems":
        return value == []
    if key in ("patternProperties", "dependentRequired", "dependentSchemas", "dependencies"):
        return value == {}
    return value is True or value == {}   # a schema that accepts everything
