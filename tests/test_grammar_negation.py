"""not and if/then/else: the compiled grammar against jsonschema on random schemas and instances.

negation.py writes the complement of a schema keyword by keyword; here random schemas over the
keywords it negates are put under ``not`` (and into if/then/else), compiled, and every random
instance's JSON text must be accepted exactly when jsonschema says the instance is valid. Two
knowing gaps are left out, as the module docstring says: integers are not written as "1.0"
(valid instances holding an integral float are not asserted), and a negated number keyword writes
no exponent (the instances here have none). What the compiler refuses must name the keyword.
"""
import itertools
import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from minillm.generation.constrained.json_grammar import Unsatisfiable, schema_to_grammar
from minillm.generation.constrained.json_schema import SchemaError
from minillm.generation.constrained.pushdown import Pushdown

KEYS = ["a", "b"]
scalar_values = st.one_of(st.integers(-3, 3), st.sampled_from([0.5, -1.5, 2.25]), st.sampled_from(["", "a", "ab", "b1", "2020-01-31"]),
                          st.booleans(), st.none())
values = st.recursive(scalar_values, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(KEYS + ["c"]), inner, max_size=2)), max_leaves=5)

leaves = st.one_of(
    st.sampled_from([{"type": t} for t in ("string", "integer", "number", "boolean", "null", "array", "object")]),
    st.lists(st.sampled_from(["string", "integer", "null", "object"]), min_size=1, max_size=2, unique=True).map(
        lambda ts: {"type": ts}),
    st.lists(scalar_values, min_size=1, max_size=3).map(lambda vs: {"enum": vs}),
    scalar_values.map(lambda v: {"const": v}),
    st.builds(lambda k, n: {k: n}, st.sampled_from(["minLength", "maxLength", "minItems", "maxItems", "minProperties",
                                                     "maxProperties"]), st.integers(0, 2)),
    st.sampled_from([{"pattern": "^a"}, {"pattern": "1$"}, {"format": "date"}, {"multipleOf": 2},
                     {"multipleOf": 0.5}, {"required": ["a"]}, {"required": ["a", "b"]}]),
    st.builds(lambda k, n: {k: n}, st.sampled_from(["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"]),
              st.sampled_from([-1, 0, 1.5, 2])),
)


def _combine(children):
    return st.one_of(
        st.builds(lambda k, c: {"properties": {k: c}}, st.sampled_from(KEYS), children),
        children.map(lambda c: {"items": c}),
        children.map(lambda c: {"contains": c}),
        st.lists(children, min_size=2, max_size=2).map(lambda cs: {"allOf": cs}),
        st.lists(children, min_size=2, max_size=2).map(lambda cs: {"anyOf": cs}),
        children.map(lambda c: {"not": c}),
        st.tuples(children, children).map(lambda ab: {**ab[0], **ab[1]}),   # two keywords side by side
    )


schemas = st.recursive(leaves, _combine, max_leaves=4)
tops = st.one_of(
    schemas.map(lambda s: {"not": s}),
    st.tuples(schemas, schemas, schemas).map(lambda t: {"if": t[0], "then": t[1], "else": t[2]}),
    st.tuples(schemas, schemas).map(lambda t: {"if": t[0], "then": t[1]}),
    schemas.map(lambda s: {"type": "object", "properties": {"a": {"not": s}}, "required": ["a"]}),
)


def texts(value):
    """The value's compact JSON texts, every order of each object's keys (the grammar writes them
    in the schema's order; objects here have at most two keys, so every order is tried)."""
    if isinstance(value, dict):
        out = []
        for order in itertools.permutations(value):
            for parts in itertools.islice(itertools.product(*(texts(value[k]) for k in order)), 6):
                out.append("{" + ",".join(f"{json.dumps(k)}:{p}" for k, p in zip(order, parts)) + "}")
        return out
    if isinstance(value, list):
        return ["[" + ",".join(p) + "]" for p in itertools.islice(itertools.product(*(texts(v) for v in value)), 12)]
    return [json.dumps(value)]


def integral_float(value) -> bool:
    if isinstance(value, float):
        return value.is_integer()
    if isinstance(value, dict):
        return any(integral_float(v) for v in value.values())
    return isinstance(value, list) and any(integral_float(v) for v in value)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tops, st.lists(values, min_size=8, max_size=8))
def test_negated_schemas_accept_exactly_the_valid_instances(schema, instances):
    oracle = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    try:
        p = Pushdown(schema_to_grammar(schema))
    except Unsatisfiable:
        assert not any(oracle.is_valid(v) for v in instances), schema
        return
    except SchemaError as e:   # what the positive side cannot build (two patterns in one allOf, contains
        # beside maxItems ...) is refused, by name; never silently
        assert "cannot be merged" in str(e) or "is not supported" in str(e), (schema, e)
        return
    note(json.dumps(schema))
    for value in instances:
        valid = oracle.is_valid(value)
        if valid and integral_float(value):
            continue
        accepted = any(p.fullmatch(t.encode()) for t in texts(value))
        assert accepted == valid, (json.dumps(schema), json.dumps(value), valid)


@pytest.mark.parametrize("schema, instances", [
    # what the sample schemas of issue 30 use
    ({"anyOf": [{"required": ["x"]}, {"not": {"properties": {"x": {}}, "required": ["x"]}}]},
     [{}, {"x": 1}, {"y": 1}, 1, "s"]),
    ({"type": "object", "additionalProperties": {"not": {"type": "null"}}}, [{"a": None}, {"a": 1}, {}]),
    ({"type": "object", "properties": {"k": {"type": "string"}, "v": {"type": "integer"}},
      "if": {"properties": {"k": {"const": "n"}}}, "then": {"required": ["v"]},
      "else": {"not": {"required": ["v"]}}}, [{"k": "n", "v": 1}, {"k": "n"}, {"k": "m"}, {"k": "m", "v": 2}, {}]),
    ({"if": {"required": ["a"]}, "then": {"properties": {"b": {"const": 1}}, "required": ["b"]}},
     [{"a": 0, "b": 1}, {"a": 0, "b": 2}, {"a": 0}, {"b": 5}]),
    ({"if": {"not": {"required": ["a"]}}, "then": {"required": ["b"]}}, [{"a": 0}, {"b": 0}, {}, {"a": 0, "b": 0}]),
    # oneOf under not: neither option, or two at once
    ({"not": {"oneOf": [{"type": "integer"}, {"minimum": 2}]}}, [1, 3, 2.5, 1.5, "x", None]),
    ({"not": {"not": {"type": "string", "minLength": 2}}}, ["ab", "a", 1]),
    # 0 and -0, 1 and 1.50 are one value each: all their spellings are excluded
    ({"type": "number", "not": {"enum": [0, 1.5]}}, [0, 1.5, 2, -3.25]),
])
def test_hand_picked_negations(schema, instances):
    p = Pushdown(schema_to_grammar(schema))
    oracle = jsonschema.Draft202012Validator(schema)
    for value in instances:
        assert any(p.fullmatch(t.encode()) for t in texts(value)) == oracle.is_valid(value), (schema, value)
    if schema.get("type") == "number":
        for spelling in (b"-0", b"0.0", b"1.50", b"1.500"):
            assert not p.fullmatch(spelling)


@pytest.mark.parametrize("schema, message", [
    ({"not": {"additionalProperties": False}}, "not at $ is not supported: additionalProperties at "
                                               "$.not.additionalProperties cannot be negated"),
    ({"not": {"patternProperties": {"^a": {}}}}, "patternProperties at $.not.patternProperties"),
    ({"properties": {"p": {"not": {"uniqueItems": True}}}}, "not at $.properties.p is not supported: uniqueItems"),
    ({"not": {"prefixItems": [{"type": "string"}]}}, "prefixItems at $.not.prefixItems"),
    ({"not": {"enum": [[1]]}}, "not at $ is not supported: $.not.enum holds an array or an object"),
    ({"if": {"propertyNames": {"maxLength": 2}}, "then": {"required": ["a"]}},
     "if at $ is not supported: propertyNames at $.if.propertyNames"),
    ({"$defs": {"n": {"properties": {"a": {"$ref": "#/$defs/n"}}}}, "not": {"$ref": "#/$defs/n"}},
     "not at $ is not supported: $ref '#/$defs/n' at #/$defs/n.properties.a.$ref leads back"),
    ({"$defs": {"n": {"not": {"$ref": "#/$defs/n"}}}, "$ref": "#/$defs/n"}, "refers back to itself"),   # n = not n
])
def test_what_cannot_be_negated_is_refused_by_name(schema, message):
    with pytest.raises(SchemaError) as e:
        schema_to_grammar(schema)
    assert message in str(e.value)


def test_if_without_then_or_else_needs_no_negation():
    """An if alone asserts nothing, so one whose negation is unsupported is no reason to refuse."""
    p = Pushdown(schema_to_grammar({"if": {"additionalProperties": False}, "type": "integer"}))
    assert p.fullmatch(b"3") and not p.fullmatch(b'"x"')
