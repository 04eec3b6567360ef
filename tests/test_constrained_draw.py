"""Chapter 11's automaton drawings: every arrow's label is the regex class of exactly the symbols
that take it (checked with Python's re and against the automaton's own moves)."""
import re

import matplotlib
import pytest

from minillm.generation.constrained.automata import DEAD, compile_byte_dfa, compile_dfa, determinize, thompson
from minillm.generation.constrained.draw import automaton_figure, ranges_label, transitions
from minillm.generation.constrained.regex import parse

matplotlib.use("Agg")
PATTERNS = ["(a|b)*abb", r"-?[0-9]+(?:\.[0-9]+)?", r'"(?:[^"\\]|\\.)*"', "[x-z^-]{1,3}|é", r"\[\]|\.+"]
PROBES = [*range(0x300), 0x4E2D, 0xFFFF, 0x10000, 0x10FFFF]  # ASCII, Latin, a CJK character, the ends


@pytest.mark.parametrize("pattern", PATTERNS)
def test_dfa_arrows_carry_exactly_the_symbols_of_each_move(pattern):
    dfa = compile_dfa(pattern)
    moves = transitions(dfa)
    for s in range(dfa.num_states):
        for c in PROBES:
            t = dfa.step(s, c)
            carried = [target for (src, target), ranges in moves.items()
                       if src == s and any(lo <= c <= hi for lo, hi in ranges)]
            assert carried == ([] if t == DEAD else [t]), (s, c)
        for (src, t), ranges in moves.items():   # and each label, read by Python's re, says the same
            if src == s:
                label = ranges_label(ranges)
                for c in PROBES:
                    assert (re.fullmatch(label, chr(c), re.DOTALL) is not None) == (dfa.step(s, c) == t), (label, c)


def test_nfa_arrows_are_its_edges_and_epsilon_moves():
    nfa = thompson(parse("(a|b)*abb"))
    moves = transitions(nfa)
    assert {k for k, v in moves.items() if v is None} == {(s, t) for s, ts in enumerate(nfa.eps) for t in ts}
    assert {k: v for k, v in moves.items() if v is not None} == {
        (s, t): ((lo, hi),) for s, edges in enumerate(nfa.edges) for lo, hi, t in edges}
    assert {ranges_label(v) for v in moves.values()} == {"ε", "a", "b"}


def test_labels_read_as_regex_classes():
    assert ranges_label(((ord("0"), ord("9")),)) == "[0-9]"
    assert ranges_label(((ord("a"), ord("b")),)) == "[ab]"
    assert ranges_label(((ord("."), ord(".")),)) == r"\."
    assert ranges_label(((0, 9), (11, 0x10FFFF))) == r"[^\n]"
    assert ranges_label(((0, 0x10FFFF),)) == "any"
    assert ranges_label(((0xC3, 0xC3),), alphabet="bytes") == r"\xc3"
    assert ranges_label(((0x80, 0xBF),), alphabet="bytes") == r"[\x80-\xbf]"
    assert ranges_label(None) == "ε"


def test_figure_has_a_circle_per_state_two_per_accepting_state_and_every_label():
    import matplotlib.pyplot as plt
    from matplotlib.patches import Circle
    for automaton, alphabet in ((determinize(thompson(parse("(a|b)*abb"))), "chars"),
                                (thompson(parse("a[bc]*")), "chars"), (compile_byte_dfa("é|中"), "bytes")):
        fig = automaton_figure(automaton, "t", alphabet)
        circles = [p for p in fig.axes[0].patches if isinstance(p, Circle)]
        accepting = 1 if not hasattr(automaton, "accepting") else int(automaton.accepting.sum())
        assert len(circles) == automaton.num_states + accepting
        texts = [t.get_text() for t in fig.axes[0].texts]
        assert sorted(t for t in texts if t.isdigit()) == sorted(str(s) for s in range(automaton.num_states))
        assert sorted(t for t in texts if not t.isdigit()) == sorted(ranges_label(r, alphabet)
                                                                    for r in transitions(automaton).values())
        plt.close(fig)
