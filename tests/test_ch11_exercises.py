"""Chapter 11's exercises, graded against Python's re and brute force (package or stubs: --impl)."""
import re

import numpy as np
import pytest

from minillm.generation.constrained.automata import DEAD, compile_byte_dfa, minimize, utf8_nfa
from minillm.generation.constrained.regex import parse

PATTERNS = ["a", "ab|c", "(?:ab)*c?", "[a-c]+x{1,3}", "(?:a|)b{0,2}", r"\d+(?:\.\d+)?", "é|中+"]
TEXTS = ["", "a", "ab", "c", "abab", "ababc", "abx", "cxxx", "cxxxx", "b", "bb", "bbb", "12", "1.5", "1.", "é", "中中"]


def nfa_accepts(nfa, text: str) -> bool:
    """Simulate the NFA directly: the set of states after each symbol (the oracle needs no DFA)."""
    def close(states):
        stack, seen = list(states), set(states)
        while stack:
            for t in nfa.eps[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return seen
    current = close({nfa.start})
    for c in map(ord, text):
        current = close({t for s in current for lo, hi, t in nfa.edges[s] if lo <= c <= hi})
    return nfa.accept in current


@pytest.mark.ch11_thompson
@pytest.mark.parametrize("pattern", PATTERNS)
def test_thompson_nfa_accepts_what_re_accepts(impl, pattern):
    nfa = impl("ch11_structured_output").thompson(parse(pattern))
    for text in TEXTS:
        assert nfa_accepts(nfa, text) == (re.fullmatch(pattern, text, re.ASCII) is not None), (pattern, text)


@pytest.mark.ch11_subset_construction
@pytest.mark.parametrize("pattern", PATTERNS)
def test_subset_construction_accepts_what_re_accepts(impl, pattern):
    from minillm.generation.constrained.automata import thompson
    dfa = impl("ch11_structured_output").determinize(thompson(parse(pattern)))
    for text in TEXTS:
        assert dfa.fullmatch(text) == (re.fullmatch(pattern, text, re.ASCII) is not None), (pattern, text)
    assert minimize(dfa).num_states <= dfa.num_states
    # and on bytes, through the UTF-8 rewriting of the NFA
    byte_dfa = impl("ch11_structured_output").determinize(utf8_nfa(thompson(parse(pattern))))
    for text in TEXTS:
        assert byte_dfa.fullmatch(text.encode()) == (re.fullmatch(pattern, text, re.ASCII) is not None)


@pytest.mark.ch11_token_mask
def test_token_mask_against_brute_force(impl):
    dfa = compile_byte_dfa(r'\{"n": (?:[0-9]+|é)\}')
    vocab = [b"{", b'{"', b'{"n": ', b"1", b"12", b"2}", b"}", b"\xc3", b"\xa9}", "é".encode(), b"", b"x", b'"']
    eos = len(vocab)
    for state in range(dfa.num_states):
        expected = [t for t, data in enumerate(vocab) if data and dfa.walk(data, state) != DEAD]
        if dfa.accepting[state]:
            expected.append(eos)
        got = impl("ch11_structured_output").allowed_tokens(dfa, state, vocab, eos)
        assert np.array_equal(np.asarray(got), expected), state
