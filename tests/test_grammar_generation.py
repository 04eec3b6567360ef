"""The JSON grammar on the real model and on random inputs, jsonschema and Decimal the oracles.

    random schemas over the supported keywords (recursive ones included) -> greedy SmolLM2 output
    under the constraint, cut short by a small max_tokens: it always parses and validates
    numeric bounds and multipleOf -> the compiled number language against Decimal arithmetic
"""
import json
from decimal import Decimal

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from minillm.generation.constrained.grammar_guide import CLOSING_MARGIN, JsonGrammar, json_pushdown
from minillm.generation.constrained.json_grammar import schema_to_grammar
from minillm.generation.constrained.pushdown import UNREACHABLE, Pushdown
from minillm.generation.constrained.unique_items import Uniqueness
from minillm.generation.sampling import SamplingParams

# ---- numbers against Decimal --------------------------------------------------------------

decimals = st.decimals(min_value=-1000, max_value=1000, places=3, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"]),
                       decimals, min_size=1, max_size=2),
       st.sampled_from([None, 2, 5, 0.5, 0.25]), st.lists(decimals, min_size=10, max_size=10))
def test_number_bounds_and_steps_match_decimal(bounds, step, values):
    schema = {"type": "number", **{k: float(v) for k, v in bounds.items()}}
    if step is not None:
        schema["multipleOf"] = step
    try:
        p = Pushdown(schema_to_grammar(schema))
    except ValueError:   # bounds that cross: jsonschema must agree that nothing in range is valid
        assert not any(jsonschema.Draft202012Validator(schema).is_valid(float(v)) for v in values)
        return
    for v in values:
        text = format(v.normalize(), "f")
        valid = jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
        if step is not None:   # exact decimal arithmetic: jsonschema's float division may round
            valid = all(_holds(k, Decimal(text), Decimal(repr(float(b)))) for k, b in bounds.items()) and \
                (Decimal(text) % Decimal(str(step))) == 0
        assert p.fullmatch(text.encode()) == valid, (schema, text)


def _holds(key, x, bound):
    return {"minimum": x >= bound, "maximum": x <= bound, "exclusiveMinimum": x > bound,
            "exclusiveMaximum": x < bound}[key]


@settings(max_examples=40, deadline=None)
@given(st.integers(-10**6, 10**6), st.integers(-10**6, 10**6), st.sampled_from([None, 3, 7, 10]),
       st.lists(st.integers(-2 * 10**6, 2 * 10**6), min_size=10, max_size=10))
def test_integer_ranges_and_steps_match_python(lo, hi, step, values):
    schema = {"type": "integer", "minimum": min(lo, hi), "maximum": max(lo, hi), **({"multipleOf": step} if step else {})}
    try:
        p = Pushdown(schema_to_grammar(schema))
    except ValueError:   # no multiple of the step in range: jsonschema must agree
        assert not any(jsonschema.Draft202012Validator(schema).is_valid(v) for v in range(min(lo, hi), max(lo, hi) + 1))
        return
    for v in values + [min(lo, hi), max(lo, hi)]:
        assert p.fullmatch(str(v).encode()) == jsonschema.Draft202012Validator(schema).is_valid(v), (schema, v)


# ---- random schemas on the real model -----------------------------------------------------

names = st.sampled_from(["id", "name", "tags", "score", "kind", "next", "when", "note"])
scalars = st.one_of(
    st.builds(lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
              st.integers(0, 3), st.integers(0, 12)),
    st.sampled_from([{"type": "string", "pattern": "[a-z]+-[0-9]"}, {"type": "string", "format": "date"},
                     {"type": "string", "format": "uuid"}, {"type": "string", "format": "ipv4"},
                     {"type": "string", "enum": ["red", "green", "blue"]}, {"const": {"a": [1, None]}},
                     {"type": "boolean"}, {"type": "null"}, {"type": ["string", "null"], "maxLength": 5}]),
    st.builds(lambda lo, width, step: {"type": "integer", "minimum": lo, "maximum": lo + width,
                                       **({"multipleOf": step} if step else {})},
              st.integers(-50, 50), st.integers(10, 1000), st.sampled_from([None, 5])),
    st.builds(lambda lo, width: {"type": "number", "minimum": lo, "exclusiveMaximum": lo + width},
              st.integers(-20, 20), st.integers(1, 100)),
)


def _objects(children, extras=(False, None, {"type": "integer"})):
    return st.builds(lambda props, required, extra: {
        "type": "object", "properties": props, "required": [n for n in props if n in required],
        **({"additionalProperties": extra} if extra is not None else {})},
        st.dictionaries(names, children, min_size=1, max_size=3), st.sets(names),
        st.sampled_from(extras))


schemas = st.recursive(scalars, lambda children: st.one_of(
    _objects(children),
    st.builds(lambda items, lo, extra: {"type": "array", "items": items, "minItems": lo, "maxItems": lo + extra},
              children, st.integers(0, 2), st.integers(0, 3)),
    st.builds(lambda first, rest: {"type": "array", "prefixItems": [first], "items": rest}, children, children),
    st.builds(lambda a, b: {"anyOf": [a, b]}, children, children),
    st.builds(lambda a, b: {"allOf": [a, {"type": "object", "required": ["extra"],
                                          "properties": {"extra": b}}]}, _objects(children, (None,)), children),
), max_leaves=5)


def recursive(node_extra: dict) -> dict:
    """A tree: each node has a value and children that are nodes again ($ref to itself)."""
    return {"$defs": {"node": {"type": "object", "required": ["value"], "additionalProperties": False,
                               "properties": {"value": node_extra, "children": {
                                   "type": "array", "items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"}


@pytest.fixture(scope="module")
def llm(smollm2_path):
    from minillm.llm import LLM
    return LLM(smollm2_path)


def validate_exactly(schema: dict, text: str) -> None:
    """jsonschema on the instance as JSON Schema reads it: a number is the decimal its text spells
    (the spec's data model), not the nearest double - "-1.00000000000000011" is below an
    exclusiveMaximum of -1, though Python's float reads it as -1.0. The schema's numbers too, so
    that a float multipleOf divides a Decimal."""
    exact = json.loads(json.dumps(schema), parse_float=Decimal)
    jsonschema.Draft202012Validator(exact, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER).validate(
        json.loads(text, parse_float=Decimal))


def shortest_fits(llm, schema, max_tokens) -> bool:
    """The grammar's shortest instance validates (jsonschema), and fits in max_tokens with the
    closing margin to spare: only then can an answer cut at max_tokens be valid at all."""
    p = json_pushdown(JsonGrammar.of(schema))
    start = {(p.start, ())}
    shortest = (Uniqueness(p).closing_text(None, start) if p.unique else
                p.closing_text(min(p.reading(start), key=p.closing_cost))).decode()
    validate_exactly(schema, shortest)
    return len(llm.tokenizer.encode(shortest, add_bos=False)) + CLOSING_MARGIN <= max_tokens


def greedy_is_valid(llm, schema, max_tokens):
    prompt = llm.chat_prompt([{"role": "user", "content": "Answer with JSON: " + json.dumps(schema)[:300]}])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, guided_json=schema),
                       use_tqdm=False)[0]
    validate_exactly(schema, out.text)   # parses even when cut by max_tokens: budget-aware closing
    assert len(out.token_ids) <= max_tokens
    return out


@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(schemas, st.sampled_from([12, 24, 48]))
def test_random_schemas_generate_valid_json(llm, schema, max_tokens):
    assume(shortest_fits(llm, schema, max_tokens))
    greedy_is_valid(llm, schema, max_tokens)


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(scalars, st.sampled_from([16, 40]))
# greedy writes {"value": -2, "children": [{"value": -1.00000000000000011}]}: valid, read as a decimal
@example({"type": "number", "minimum": -2, "exclusiveMaximum": -1}, 40)
def test_recursive_schemas_generate_valid_json(llm, value, max_tokens):
    assume(shortest_fits(llm, recursive(value), max_tokens))
    greedy_is_valid(llm, recursive(value), max_tokens)


@pytest.mark.slow
def test_an_answer_cut_by_max_tokens_still_validates(llm):
    """The old failure of issue 30: a long free string at max_tokens was invalid JSON. Now the last
    tokens close it (a few tokens early: the closing margin)."""
    schema = {"type": "object", "required": ["story", "tags"], "properties": {
        "story": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1}}}
    free = greedy_is_valid(llm, schema, 200)
    assert len(free.token_ids) > 20            # this answer does not fit in 20 tokens by itself
    out = greedy_is_valid(llm, schema, 20)     # yet within 20 it parses and validates
    assert out.text != free.text


CONDITIONAL = {"type": "object", "required": ["kind", "tags"], "properties": {
    "kind": {"enum": ["list", "note"]},
    "tags": {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 2, "uniqueItems": True},
    "size": {"type": "integer", "not": {"enum": [0, 1]}},
    "note": {"type": "string", "not": {"pattern": "^$"}}},
    "if": {"properties": {"kind": {"const": "list"}}}, "then": {"required": ["size"]},
    "else": {"not": {"required": ["size"]}}}


@pytest.mark.slow
@pytest.mark.parametrize("max_tokens", [24, 32, 64, 200])
def test_not_if_and_unique_items_generate_valid_json(llm, max_tokens):
    """Greedy SmolLM2 under not, if/then/else and uniqueItems: valid whole or cut by max_tokens."""
    assert shortest_fits(llm, CONDITIONAL, max_tokens)
    greedy_is_valid(llm, CONDITIONAL, max_tokens)


@pytest.mark.slow
def test_greedy_repetition_is_turned_into_distinct_items(llm):
    """Asked for the same word many times, the model would repeat it: the items come out distinct."""
    schema = {"type": "array", "items": {"type": "string", "enum": ["yes", "no", "maybe"]}, "minItems": 3,
              "uniqueItems": True}
    prompt = llm.chat_prompt([{"role": "user", "content": 'Answer with a JSON list: write "yes" three times.'}])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, guided_json=schema), use_tqdm=False)[0]
    assert sorted(json.loads(out.text)) == ["maybe", "no", "yes"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schemas)
def test_every_live_state_can_finish(schema):
    """A mask may only admit a byte after which the text can still be completed: every state that
    any move or call leads to has a finite closing length (a rule DFA that is not trim - e.g. one
    that lets a character start at maxLength - breaks this and dead-ends generation)."""
    p = Pushdown(schema_to_grammar(schema))
    targets = np.concatenate([p.table[p.table >= 0], p.call_targets, p.call_returns, [p.start]])
    assert (p.close_bytes[targets] < UNREACHABLE).all()
    tail = [t for t in (p.closing_text(c) for c in p.reading(p.walk(b""))) if t is not None]
    assert any(p.fullmatch(t) for t in tail)


def test_properties_are_written_in_the_order_the_schema_lists_them():
    """Not alphabetically: the schema lists "name" after "zone", and so must the answer."""
    schema = {"type": "object", "properties": {"zone": {"type": "integer"}, "name": {"type": "string"}},
              "required": ["zone", "name"], "additionalProperties": False}
    p = json_pushdown(JsonGrammar.of(schema))
    assert p.fullmatch(b'{"zone": 1, "name": "a"}') or p.fullmatch(b'{"zone":1,"name":"a"}')
    assert not p.fullmatch(b'{"name": "a", "zone": 1}') and not p.fullmatch(b'{"name":"a","zone":1}')
    reordered = {**schema, "properties": {"name": {"type": "string"}, "zone": {"type": "integer"}}}
    assert JsonGrammar.of(reordered) != JsonGrammar.of(schema)
