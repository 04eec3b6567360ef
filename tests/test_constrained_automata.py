"""The regex compiler against Python's re: the minimal DFA accepts exactly what re.fullmatch does."""
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm.generation.constrained.automata import (compile_byte_dfa, compile_dfa, determinize, minimize,
                                                     thompson, utf8_nfa, utf8_sequences)
from minillm.generation.constrained.regex import RegexError, escape, parse

ALPHABET = "ab-é中😀\n"   # ASCII, 2-, 3- and 4-byte UTF-8 characters, and the newline '.' skips

atoms = st.sampled_from(["a", "b", "é", "中", "😀", ".", "[ab]", "[^a]", "[a-é]", r"\d", r"\w", r"\s", r"\.", "-",
                         r"\n", "[中-😀]", r"\u00e9"])


def _patterns():
    def extend(inner):
        return st.one_of(
            st.tuples(inner, inner).map("".join),
            st.tuples(inner, inner).map(lambda t: f"{t[0]}|{t[1]}"),
            inner.map(lambda p: f"(?:{p})*"), inner.map(lambda p: f"({p})+"), inner.map(lambda p: f"(?:{p})?"),
            st.tuples(inner, st.integers(0, 2), st.integers(0, 2)).map(
                lambda t: f"(?:{t[0]}){{{min(t[1:])},{max(t[1:])}}}"),
        )
    return st.recursive(atoms, extend, max_leaves=8)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pattern=_patterns(), data=st.data())
def test_dfa_accepts_what_re_fullmatch_accepts(pattern, data):
    dfa, byte_dfa = compile_dfa(pattern), compile_byte_dfa(pattern)
    compiled = re.compile(pattern, re.ASCII)
    texts = data.draw(st.lists(st.text(ALPHABET, max_size=6), min_size=5, max_size=5))
    # positives; surrogates are no text that UTF-8 (or a tokenizer) can carry, so sets leave them out
    positives = st.from_regex(compiled, fullmatch=True).filter(lambda t: not any(0xD800 <= ord(c) <= 0xDFFF for c in t))
    texts += data.draw(st.lists(positives, min_size=3, max_size=3))
    for text in texts:
        expected = compiled.fullmatch(text) is not None
        assert dfa.fullmatch(text) == expected, (pattern, text)
        assert byte_dfa.fullmatch(text.encode("utf-8")) == expected, (pattern, text)


@settings(max_examples=60, deadline=None)
@given(pattern=_patterns())
def test_minimize_keeps_the_language_and_is_a_fixed_point(pattern):
    dfa = determinize(thompson(parse(pattern)))
    small = minimize(dfa)
    assert small.num_states <= dfa.num_states
    assert minimize(small).num_states == small.num_states


def test_minimal_state_counts_are_the_textbook_ones():
    assert compile_dfa("(a|b)*abb").num_states == 4          # the dragon book's example
    assert compile_dfa("a*").num_states == 1
    assert compile_dfa("(?:aa)*").num_states == 2
    assert compile_dfa("a{3}").num_states == 4


@settings(max_examples=200, deadline=None)
@given(lo=st.integers(0, 0x10FFFF), width=st.integers(0, 70000), probe=st.integers(0, 0x10FFFF))
def test_utf8_sequences_cover_exactly_the_range(lo, width, probe):
    hi = min(lo + width, 0x10FFFF)
    if 0xD800 <= probe <= 0xDFFF:
        return
    encoded = chr(probe).encode("utf-8")
    hit = any(len(seq) == len(encoded) and all(a <= b <= c for (a, c), b in zip(seq, encoded))
              for seq in utf8_sequences(lo, hi))
    assert hit == (lo <= probe <= hi)


def test_utf8_nfa_reads_bytes():
    dfa = minimize(determinize(utf8_nfa(thompson(parse("[é-中]+")))))
    assert dfa.fullmatch("éü中".encode())
    assert not dfa.fullmatch("é".encode()[:1])       # half a character is not a match
    assert not dfa.fullmatch("a".encode())


@pytest.mark.parametrize("pattern, complaint", [
    ("a*?", "lazy"), (r"(a)\1", "backreference"), ("(?=a)", "non-capturing"), ("a^b", "'^'"),
    ("a$b", "'$'"), ("*a", "nothing to repeat"), ("(ab", "missing ')'"), ("ab)", "unbalanced"),
    ("a{3,2}", "max below min"), ("[z-a]", "bad range"), (r"\p{L}", r"\p"), ("[[:alpha:]]", "POSIX"),
])
def test_unsupported_constructs_are_named(pattern, complaint):
    with pytest.raises(RegexError, match=re.escape(complaint)):
        parse(pattern)


@given(st.text(max_size=12))
def test_escape_matches_the_text_literally(text):
    text = "".join(c for c in text if not 0xD800 <= ord(c) <= 0xDFFF)
    assert compile_dfa(escape(text)).fullmatch(text)
