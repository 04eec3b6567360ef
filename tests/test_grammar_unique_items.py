"""uniqueItems checked at run time (unique_items.py), jsonschema the oracle.

    byte level     random arrays of scalars: accepted by the grammar and the run-time check
                   together exactly when jsonschema says valid (values compared: 1 == 1.0 == 1.00,
                   -0 == 0, true != 1); the lazily read spellings of used values end on an
                   accepting state exactly for the texts jsonschema calls duplicates
    token level    random walks through the guide's masks on SmolLM2's vocabulary, any allowed
                   token picked at random, within a max_tokens budget: the mask is never empty and
                   every finished text validates - no duplicate, no dead end, closing in time
    refusals       items that may be arrays or objects, positional items: refused by name; too
                   few distinct values for minItems: unsatisfiable
"""
import json
import random

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm.generation.constrained.grammar_guide import GrammarGuide, JsonGrammar, grammar_index
from minillm.generation.constrained.json_grammar import Unsatisfiable, schema_to_grammar
from minillm.generation.constrained.json_schema import SchemaError
from minillm.generation.constrained.pushdown import Pushdown
from minillm.generation.constrained.unique_items import (Uniqueness, read_spellings, spelled_out, start_spellings,
                                                           value_key)

SCHEMAS = [
    {"type": "array", "items": {"enum": ["a", "ab", "abc"]}, "uniqueItems": True, "minItems": 3},
    {"type": "array", "items": {"type": "string", "maxLength": 1}, "uniqueItems": True, "minItems": 2},
    {"type": "array", "items": {"type": "integer", "minimum": -2, "maximum": 2}, "uniqueItems": True},
    {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "uniqueItems": True, "minItems": 2},
    {"type": "array", "items": {"enum": [1, 1.0, True, None, "1"]}, "uniqueItems": True, "minItems": 4},
    {"type": "array", "items": {"type": ["boolean", "null"]}, "uniqueItems": True, "maxItems": 5},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "uniqueItems": True, "minItems": 2},
    {"type": "object", "required": ["tags", "n"], "properties": {
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-c]{1,2}$"}, "uniqueItems": True,
                 "minItems": 2},
        "n": {"type": "integer", "not": {"enum": [0, 1]}}}},
]
pool = st.sampled_from([0, 1, 2, -1, 1.0, 0.5, 0.50, "a", "ab", "abc", "", "1", "b", True, False, None])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(SCHEMAS[:6]), st.lists(pool, max_size=5), st.sampled_from([(",", ":"), (", ", ": ")]))
def test_arrays_of_scalars_match_jsonschema(schema, items, separators):
    check = Uniqueness(Pushdown(schema_to_grammar(schema))).fullmatch
    text = json.dumps(items, separators=separators)
    valid = jsonschema.Draft202012Validator(schema).is_valid(items)
    if schema["items"].get("type") == "integer" and any(isinstance(v, float) for v in items):
        valid = False   # the documented subset: integers are written without a fraction ("1.0" is not produced)
    assert check(text.encode()) == valid, (schema, text)


@pytest.mark.parametrize("text, valid", [
    ("[0.5, 0.50]", False), ("[0.5, 0.500, 1]", False), ("[0, -0]", False), ("[0, 0.0]", False),
    ("[1, 1.0]", False), ("[0.5, 1.0]", True), ("[0, 0.25, 1]", True),
])
def test_numbers_are_compared_by_value(text, valid):
    schema = SCHEMAS[3]
    assert Uniqueness(Pushdown(schema_to_grammar(schema))).fullmatch(text.encode()) == valid
    assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)) == valid


SPELLINGS = ["0", "-0", "0.0", "1", "1.0", "1.50", "1.5", "12", "-12.000", '"a"', '"ab"', '"1"', '""', "true",
             "false", "null", '"' + "a long item, of the kind that made the masks slow " * 4 + '"']


@settings(max_examples=200, deadline=None)
@given(st.sets(st.sampled_from(SPELLINGS), max_size=5), st.sampled_from(SPELLINGS))
def test_spellings_accept_exactly_the_values_used(used, text):
    """The spellings of the used values, read lazily: a text is spelled out exactly when jsonschema
    calls it a duplicate of a used value (1 == 1.0, true != 1), and every prefix of a used value's
    text keeps some spelling alive."""
    start = start_spellings(frozenset(value_key(u.encode()) for u in used))
    unique = jsonschema.Draft202012Validator({"uniqueItems": True}).is_valid
    duplicate = any(not unique([json.loads(u), json.loads(text)]) for u in used)
    assert spelled_out(read_spellings(text.encode(), start)) == duplicate, (used, text)
    for u in used:
        data = u.encode()
        assert all(read_spellings(data[:k], start) for k in range(len(data) + 1)), (used, u)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from minillm.generation.tokenizer import Tokenizer
    return Tokenizer.from_gguf(smollm2_path)


def random_walk(index, rng, max_tokens):
    """Random allowed tokens (jump-forward now and then) until the guide ends the text; mostly
    tokens that copy bytes already written, to try repeating items."""
    guide, tokens, written = GrammarGuide(index, max_tokens=max_tokens), [], b""
    while len(tokens) < max_tokens:
        forced = guide.forced_tokens() if rng.random() < 0.3 else []
        if forced == [index.eos_id] or (not forced and guide.accepting and rng.random() < 0.2):
            break
        choices = forced[:1] or guide.allowed().tolist()
        assert choices, f"dead end after {index.tokenizer.decode(tokens)!r}"
        copying = [t for t in choices if t != index.eos_id and index.tokenizer.id_to_bytes[t] in written]
        token = rng.choice(copying if copying and rng.random() < 0.7 else choices)
        written += index.tokenizer.id_to_bytes[token] if token != index.eos_id else b""
        if token == index.eos_id:
            break
        guide.advance(token)
        tokens.append(token)
    assert guide.accepting, f"not complete after {len(tokens)} tokens: {index.tokenizer.decode(tokens)!r}"
    return index.tokenizer.decode(tokens)


@pytest.mark.parametrize("schema", SCHEMAS)
def test_random_walks_through_the_masks_end_valid(tokenizer, schema):
    index = grammar_index(JsonGrammar.of(schema), tokenizer)
    rng = random.Random(0)
    for max_tokens in (16, 24, 40, 40, 64, 64):
        text = random_walk(index, rng, max_tokens)
        jsonschema.Draft202012Validator(schema).validate(json.loads(text))


UNIQUE_INTS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3}, "uniqueItems": True}
ALTERNATIVES = [
    {"anyOf": [UNIQUE_INTS, {"type": "array", "items": {"type": "integer"}, "maxItems": 3}]},
    {"anyOf": [UNIQUE_INTS, {"type": "array", "items": {"type": "string"}}]},
    {"anyOf": [UNIQUE_INTS, {"type": "array", "items": {"type": "integer", "minimum": 1}, "uniqueItems": True}]},
    {"type": "object", "properties": {"a": {"anyOf": [UNIQUE_INTS, {"type": "array", "maxItems": 2}]}}},
]


@pytest.mark.parametrize("schema", ALTERNATIVES)
@pytest.mark.parametrize("value", [[1, 1], [1, 2], [1, 1, 1], [1, 1, 1, 1], [0, 1, 2, 3], [2, 1, 2], ["a", "a"], [],
                                   [3, 3]])
def test_an_option_beside_a_unique_array_keeps_what_it_allows(schema, value):
    """anyOf: a duplicate ends only the parses that read a uniqueItems array; jsonschema decides."""
    check = Uniqueness(Pushdown(schema_to_grammar(schema))).fullmatch
    instance = {"a": value} if schema.get("type") == "object" else value
    text = json.dumps(instance, separators=(",", ":"))
    assert check(text.encode()) == jsonschema.Draft202012Validator(schema).is_valid(instance), text


def test_the_mask_allows_a_duplicate_where_an_option_allows_it(tokenizer):
    """The masks agree: after "[1," the item "1" may follow (the plain option), and a walk that
    repeats items ends valid."""
    schema = ALTERNATIVES[0]
    index = grammar_index(JsonGrammar.of(schema), tokenizer)
    guide = GrammarGuide(index)
    for token in tokenizer.encode("[1,", add_bos=False):
        guide.advance(token)
    assert b"1" in {tokenizer.id_to_bytes[t] for t in guide.allowed()}
    guide.advance(tokenizer.encode("1", add_bos=False)[0])
    assert any(tokenizer.id_to_bytes[t].startswith(b"]") for t in guide.allowed())
    rng = random.Random(1)
    for max_tokens in (8, 12, 16, 24):
        jsonschema.Draft202012Validator(schema).validate(json.loads(random_walk(index, rng, max_tokens)))


def test_no_comma_when_no_fresh_value_is_left(tokenizer):
    """Both values used: a "," would open an item that can only repeat one, so only "]" may come;
    and after '"ab' the closing quote is out ("ab" is used) but 'c' is not."""
    schema = {"type": "array", "items": {"enum": ["ab", "abc"]}, "uniqueItems": True}
    index = grammar_index(JsonGrammar.of(schema), tokenizer)
    guide = GrammarGuide(index)
    for token in tokenizer.encode('["ab","abc"', add_bos=False):
        guide.advance(token)
    allowed = [tokenizer.id_to_bytes[t] for t in guide.allowed()]
    assert allowed and all(data.startswith(b"]") for data in allowed)
    guide = GrammarGuide(index)
    for token in tokenizer.encode('["ab", "ab', add_bos=False):
        guide.advance(token)
    allowed = [tokenizer.id_to_bytes[t] for t in guide.allowed()]
    assert b"c" in allowed and not any(data.startswith(b'"') for data in allowed)


@pytest.mark.parametrize("schema, message", [
    ({"type": "array", "uniqueItems": True}, "uniqueItems at $ is not supported for items that may be arrays or objects"),
    ({"properties": {"o": {"type": "array", "items": {"type": "object"}, "uniqueItems": True}}},
     "uniqueItems at $.properties.o is not supported for items that may be arrays or objects"),
    ({"type": "array", "items": {"enum": ["a", [1]]}, "uniqueItems": True}, "may be arrays or objects"),
    ({"type": "array", "prefixItems": [{"type": "string"}], "uniqueItems": True},
     "uniqueItems at $ is not supported beside prefixItems"),
])
def test_what_cannot_be_compared_is_refused_by_name(schema, message):
    with pytest.raises(SchemaError) as e:
        schema_to_grammar(schema)
    assert message in str(e.value)


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True, "minItems": 3},
    {"type": "array", "items": {"type": "number", "minimum": 1, "maximum": 1}, "uniqueItems": True, "minItems": 2},
    {"type": "array", "items": {"enum": [1, 1.0]}, "uniqueItems": True, "minItems": 2},
])
def test_too_few_distinct_values_is_unsatisfiable(schema):
    with pytest.raises(Unsatisfiable):
        schema_to_grammar(schema)


def test_one_item_at_most_needs_no_run_time_check():
    p = Pushdown(schema_to_grammar({"type": "array", "items": {"type": "object"}, "uniqueItems": True, "maxItems": 1}))
    assert not p.unique and p.fullmatch(b"[{}]")
