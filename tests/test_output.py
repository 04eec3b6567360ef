"""OutputBuilder: when a sequence ends and what text it shows (facts of the sampling semantics)."""
import pytest

from minillm.generation.output import OutputBuilder
from minillm.generation.sampling import SamplingParams
from minillm.generation.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return Tokenizer.from_gguf(smollm2_path)


def feed(builder, ids):
    return "".join(builder.append(t) for t in ids if not builder.finished)


def test_eos_ends_with_stop_and_never_shows(tok):
    ids = tok.encode("Paris.") + [tok.eos_id] + tok.encode(" more")
    b = OutputBuilder(tok, SamplingParams(max_tokens=50), prompt_len=5, context_length=100)
    assert feed(b, ids) == "Paris."
    assert b.output.finish_reason == "stop" and b.output.token_ids[-1] == tok.eos_id


def test_ignore_eos_keeps_going_until_max_tokens(tok):
    ids = tok.encode("Paris.") + [tok.eos_id] + tok.encode(" and more words here")
    b = OutputBuilder(tok, SamplingParams(max_tokens=len(ids), ignore_eos=True), prompt_len=5, context_length=100)
    assert feed(b, ids) == "Paris. and more words here"
    assert b.output.finish_reason == "length" and len(b.output.token_ids) == len(ids)


def test_stop_token_ids_end_the_sequence(tok):
    ids = tok.encode("a b c d")
    b = OutputBuilder(tok, SamplingParams(stop_token_ids=[ids[2]]), prompt_len=1, context_length=100)
    feed(b, ids)
    assert b.output.token_ids == ids[:3] and b.output.stop_reason == ids[2]


def test_a_full_context_ends_with_length(tok):
    b = OutputBuilder(tok, SamplingParams(max_tokens=None), prompt_len=97, context_length=100)
    feed(b, tok.encode("one two three four five"))
    assert len(b.output.token_ids) == 3 and b.output.finish_reason == "length"


def test_stop_strings_wait_for_min_tokens(tok):
    ids = tok.encode("Hi. Yes. No.")
    b = OutputBuilder(tok, SamplingParams(stop=["."], min_tokens=3), prompt_len=1, context_length=100)
    text = feed(b, ids)
    assert text == "Hi. Yes" and b.output.finish_reason == "stop" and b.output.stop_reason == "."


def test_a_multibyte_character_split_across_tokens_is_never_garbled(tok):
    ids = tok.encode("猫🙂")
    b = OutputBuilder(tok, SamplingParams(max_tokens=len(ids)), prompt_len=1, context_length=100)
    pieces = [b.append(t) for t in ids]
    assert "".join(pieces) == "猫🙂" and all("\ufffd" not in p for p in pieces)
