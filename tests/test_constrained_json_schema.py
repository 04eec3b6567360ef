"""JSON Schema -> regex against jsonschema: a JSON text (json.dumps' layout, properties in the
schema's order) matches the regex exactly when jsonschema says the instance is valid."""
import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm.generation.constrained.automata import compile_dfa
from minillm.generation.constrained.json_schema import SchemaError, integer_range_regex, schema_to_regex

KEYS = ["name", "age", "tags", "ok", "when", "score", "extra"]   # every corpus object lists its properties in this order


def obj(props: dict, required=(), **more) -> dict:
    assert list(props) == sorted(props, key=KEYS.index)
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False, **more}


CORPUS = [
    {"type": "string"},
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"type": "string", "enum": ["red", "green", "a \"quoted\" one", "é"]},
    {"type": "string", "pattern": "^[a-c]{1,3}-[0-9]$"},
    {"type": "integer"},
    {"type": "integer", "minimum": -15, "maximum": 120},
    {"type": "integer", "exclusiveMinimum": 7},
    {"type": "integer", "exclusiveMaximum": -3},
    {"type": "number"},
    {"type": "number", "minimum": 0},
    {"type": "boolean"},
    {"type": "null"},
    {"type": ["string", "null"]},
    {"enum": [1, "one", None, True, [1, 2]]},
    {"const": "fixed"},
    {"type": "array", "items": {"type": "integer"}},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"type": "string"}, "maxItems": 0},
    {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "maxLength": 2}]},
    obj({"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}}, ["name", "age"]),
    obj({"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
         "ok": {"type": "boolean"}}, ["age"]),
    obj({"name": {"type": "string"}, "ok": {"type": "boolean"}, "score": {"type": "number"}}),   # all optional
    obj({"name": {"$ref": "#/$defs/short"}, "when": obj({"age": {"type": "integer"}, "ok": {"type": "null"}}, ["ok"])},
        ["when"], **{"$defs": {"short": {"type": "string", "maxLength": 3, "description": "an annotation"}}}),
]


def canonical(value) -> str:
    return json.dumps(value, ensure_ascii=False)


scalars = st.one_of(st.none(), st.booleans(), st.integers(-200, 200),
                    st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: not f.is_integer()),
                    st.sampled_from(["", "red", "é", "ab", "abc", "a-1", "ccc-9", "fixed", "one", "a \"quoted\" one"]),
                    st.text(max_size=5).filter(lambda t: not any(0xD800 <= ord(c) <= 0xDFFF for c in t)))
# objects keep KEYS' order, as a generator following the schema would write them
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.sampled_from(KEYS), inner, max_size=4).map(lambda d: {k: d[k] for k in KEYS if k in d})),
    max_leaves=8)


@pytest.mark.parametrize("schema", CORPUS, ids=[json.dumps(s)[:50] for s in CORPUS])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors])
@given(data=st.data())
def test_regex_accepts_exactly_the_valid_instances(schema, data):
    pattern = schema_to_regex(schema)
    dfa, validator = compile_dfa(pattern), jsonschema.Draft202012Validator(schema)
    for value in data.draw(st.lists(values, min_size=4, max_size=4)):
        text = canonical(value)
        assert dfa.fullmatch(text) == validator.is_valid(value), (schema, text)
        assert (re.fullmatch(pattern, text) is not None) == validator.is_valid(value), (schema, text)
    # and every text the regex matches is a valid instance
    for text in data.draw(st.lists(st.from_regex(pattern, fullmatch=True), min_size=3, max_size=3)):
        if not any(0xD800 <= ord(c) <= 0xDFFF for c in text):
            assert validator.is_valid(json.loads(text)), (schema, text)


def test_hand_written_instances():
    schema = CORPUS[20]
    dfa = compile_dfa(schema_to_regex(schema))
    assert dfa.fullmatch('{"age": 3}')
    assert dfa.fullmatch('{"name": "x", "age": -1, "tags": ["a", "b"], "ok": false}')
    assert not dfa.fullmatch('{"name": "x"}')                 # age is required
    assert not dfa.fullmatch('{"age": 3, "name": "x"}')       # properties come in the schema's order
    assert not dfa.fullmatch('{"age":3}')                     # the whitespace policy: json.dumps' separators
    assert not dfa.fullmatch('{"age": 3,}')


@pytest.mark.parametrize("lo, hi", [(0, None), (5, 123), (-17, 42), (None, -3), (1000, None), (-250, -13), (7, 7)])
def test_integer_ranges(lo, hi):
    pattern = integer_range_regex(lo, hi)
    for n in range(-400, 1500):
        assert (re.fullmatch(pattern, str(n)) is not None) == ((lo is None or n >= lo) and (hi is None or n <= hi))
    assert not any(re.fullmatch(pattern, t) for t in ("-0", "01", "007"))


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "string", "format": "date-time"}, "'format'"),
    ({"type": "integer", "multipleOf": 3}, "'multipleOf'"),
    ({"oneOf": [{"type": "string"}]}, "'oneOf'"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True}, "additionalProperties"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "[a-z]+"}}}, "anchored"),
    ({"$ref": "#/$defs/node", "$defs": {"node": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}, "recursive"),
    ({"type": "number", "maximum": 3.5}, "maximum"),
    ({"type": "array"}, "items"),
])
def test_unsupported_keywords_are_named(schema, keyword):
    with pytest.raises(SchemaError, match=re.escape(keyword)):
        schema_to_regex(schema)
