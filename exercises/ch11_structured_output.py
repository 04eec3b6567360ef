"""Chapter 11 exercises: structured output.

Three pieces of the constrained-decoding compiler, each with exactly the signature of the
package's own version (see REFERENCE; read it after you have tried). Grade your work with

    .venv/bin/python -m pytest tests/test_ch11_exercises.py \
        -m "ch11_thompson or ch11_subset_construction or ch11_token_mask" --impl=exercises

Task 1 (ch11_thompson)            thompson: regex syntax tree -> NFA (one fragment per node)
Task 2 (ch11_subset_construction) determinize: NFA -> DFA, one DFA state per set of NFA states
Task 3 (ch11_token_mask)          allowed_tokens: the tokens one DFA state allows
"""
from __future__ import annotations

import numpy as np

from minillm.generation.constrained.automata import DEAD, DFA, NFA  # noqa: F401  (what you build and return)
from minillm.generation.constrained.budget import CompileBudget
from minillm.generation.constrained.regex import Alternate, Chars, Concat, Repeat  # noqa: F401  (the tree's nodes)

REFERENCE = {
    "thompson": "minillm.generation.constrained.automata.thompson",
    "determinize": "minillm.generation.constrained.automata.determinize",
    "allowed_tokens": "minillm.generation.constrained.token_index.allowed_tokens",
}

# The functions each task (pytest marker) grades: course.check(marker) runs its tests.
TASKS = {
    "ch11_thompson": ["thompson"],
    "ch11_subset_construction": ["determinize"],
    "ch11_token_mask": ["allowed_tokens"],
}


def thompson(node, budget: CompileBudget | None = None) -> NFA:
    """Task 1: the NFA of a syntax tree (Chars, Concat, Alternate, Repeat), by Thompson's construction.

    Build it in an ``NFA()``: ``add_state()`` makes a state; append (lo, hi, target) to
    ``edges[s]`` for a move on symbols lo..hi and a target to ``eps[s]`` for a move on nothing.
    Set ``start`` and ``accept``. Each node becomes a fragment with one entry and one exit;
    ``Repeat(node, lo, hi)`` is lo copies then hi - lo optional ones (hi None: a loop).
    ``budget``: the engine passes its compile budget; ``budget.count("nfa_states", n)`` as the NFA
    grows refuses a pattern too large (the graded tests pass none: ignoring it is correct too).
    """
    raise NotImplementedError("chapter 11, task 1")


def determinize(nfa: NFA) -> DFA:
    """Task 2: subset construction. A DFA state is the epsilon-closed set of NFA states the input
    so far could have reached; the start is the closure of {nfa.start}; a set accepts when it holds
    nfa.accept. Cut the symbols into classes at every edge's lo and hi + 1 (``boundaries``, starting
    at 0) and fill ``table[state, class]`` with the next state or DEAD. State 0 is the start.
    """
    raise NotImplementedError("chapter 11, task 2")


def allowed_tokens(dfa: DFA, state: int, token_bytes: list[bytes], eos_id: int | None = None) -> np.ndarray:
    """Task 3: the sorted ids of the tokens allowed in `state`: those whose bytes walk from it
    (``dfa.step`` byte by byte) without reaching DEAD, plus `eos_id` when `state` is accepting.
    An empty token (a special one) is never allowed.
    """
    raise NotImplementedError("chapter 11, task 3")
