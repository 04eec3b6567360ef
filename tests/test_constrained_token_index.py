"""The token index against brute force: decode each token, run the byte DFA from the state."""
import importlib

import numpy as np
import pytest

from minillm.generation.constrained import Guide, schema_to_regex, token_index
from minillm.generation.constrained.automata import DEAD
from minillm.generation.tokenizer import BYTE_TO_SYMBOL, Tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "temp"],
          "properties": {"city": {"type": "string", "enum": ["Zürich", "東京", "Paris"]},
                         "temp": {"type": "integer", "minimum": -50, "maximum": 60},
                         "note": {"type": "string", "maxLength": 8}}}
PATTERNS = [schema_to_regex(SCHEMA), r"(?:[a-z]+|é+|中文|😀)( [0-9]{1,3})?", r"\{\"a\": (?:true|false)\}"]


def brute_force(index, tokenizer, state: int) -> tuple[list[int], list[int]]:
    """Every token allowed in `state`, and where it leads, one token at a time."""
    ids, nexts = [], []
    for t in range(tokenizer.vocab_size):
        data = tokenizer.id_to_bytes[t]
        if t in tokenizer.special_ids or t in tokenizer.added_ids or not data:
            continue
        end = index.dfa.walk(data, state)
        if end != DEAD:
            ids.append(t)
            nexts.append(end)
    if index.dfa.accepting[state]:
        ids.append(tokenizer.eos_id)
        nexts.append(state)
    order = np.argsort(ids, kind="stable")
    return list(np.array(ids)[order]), list(np.array(nexts)[order])


def check_index(pattern, tokenizer, states):
    index = token_index(pattern, tokenizer)
    for state in states:
        ids, nexts = brute_force(index, tokenizer, state)
        lo, hi = index.offsets[state], index.offsets[state + 1]
        assert list(index.allowed(state)) == ids, (pattern, state)
        assert list(index.next_states[lo:hi]) == nexts, (pattern, state)
    return index


@pytest.fixture(scope="module")
def tiny_tokenizer():
    """Every single byte, a few merged tokens - one ending in the middle of 'é' - and an EOS."""
    symbols = [BYTE_TO_SYMBOL[b] for b in range(256)]
    e_acute = "é".encode()
    extra = ["ab", "Ġ1", BYTE_TO_SYMBOL[ord("a")] + BYTE_TO_SYMBOL[e_acute[0]],        # "a" + half of "é"
             "".join(BYTE_TO_SYMBOL[b] for b in "中文".encode()), "{\"", "<|end|>"]
    tokens = symbols + extra
    eos = len(tokens) - 1
    return Tokenizer(tokens, [], [r"\S+|\s+"], added_ids=[eos], special_ids=[eos], eos_id=eos)


def test_tiny_vocabulary_against_brute_force(tiny_tokenizer):
    for pattern in PATTERNS:
        index = token_index(pattern, tiny_tokenizer)
        check_index(pattern, tiny_tokenizer, range(index.num_states))


def test_eos_only_where_the_text_may_end(tiny_tokenizer):
    index = token_index(PATTERNS[1], tiny_tokenizer)
    eos = tiny_tokenizer.eos_id
    for state in range(index.num_states):
        assert (eos in index.allowed(state)) == bool(index.dfa.accepting[state])


def test_a_token_may_end_inside_a_character(tiny_tokenizer):
    guide = Guide(token_index("aé+", tiny_tokenizer))
    half = tiny_tokenizer.token_to_id[BYTE_TO_SYMBOL[ord("a")] + BYTE_TO_SYMBOL["é".encode()[0]]]
    assert half in guide.allowed()
    guide.advance(half)                        # "a" and the first byte of "é"
    assert list(guide.allowed()) == ["é".encode()[1]]   # only the byte that finishes the character
    assert guide.forced_tokens() == []         # jump-forward never starts mid-character
    guide.advance("é".encode()[1])
    assert guide.accepting


def test_forced_tokens_follow_the_only_continuation(tiny_tokenizer):
    guide = Guide(token_index(PATTERNS[2], tiny_tokenizer))
    forced = guide.forced_tokens()
    assert tiny_tokenizer.decode(forced) == '{"a": '
    for t in forced:
        guide.advance(t)
    guide.advance(tiny_tokenizer.token_to_id["t"])
    assert tiny_tokenizer.decode(guide.forced_tokens()) == "rue}"


@pytest.mark.slow
def test_real_vocabulary_against_brute_force(smollm2_path):
    tokenizer = Tokenizer.from_gguf(smollm2_path)
    rng = np.random.default_rng(0)
    for pattern in PATTERNS:
        index = token_index(pattern, tokenizer)
        states = rng.choice(index.num_states, size=min(4, index.num_states), replace=False)
        check_index(pattern, tokenizer, [0, *map(int, states)])


def test_another_mask_in_place_of_allowed_tokens_is_asked_state_by_state_and_never_served_the_cached_index(
        tiny_tokenizer, monkeypatch):
    """The course's seat for chapter 11's token mask: the index asks the function set there for each
    state (brute force's index all the same), and the cache keeps it apart from the trie-walked one."""
    module = importlib.import_module("minillm.generation.constrained.token_index")
    pattern, asked = PATTERNS[1], []

    def mask(dfa, state, token_bytes, eos_id=None):
        asked.append(state)
        return module.TRIE_WALK_COMPUTES(dfa, state, token_bytes, eos_id)

    walked = token_index(pattern, tiny_tokenizer)
    monkeypatch.setattr(module, "allowed_tokens", mask)
    index = check_index(pattern, tiny_tokenizer, range(walked.num_states))
    assert index is not walked and asked == list(range(index.num_states))
    monkeypatch.setattr(module, "allowed_tokens", lambda dfa, state, token_bytes, eos_id=None: [])
    assert token_index(pattern, tiny_tokenizer).allowed(0).size == 0   # a wrong mask is what the index holds
    monkeypatch.undo()
    assert token_index(pattern, tiny_tokenizer) is walked
