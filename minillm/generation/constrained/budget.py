"""The compile budget: every constraint is compiled within bounds checked as it grows.

A constraint of a few bytes can ask for an automaton of billions of states (``(a{1000}){1000}``),
a schema of a kilobyte for a regex of megabytes (nested arrays double it per level). Checking
the size only at the end means paying for the blow-up first - seconds of one core and gigabytes
of memory while every other request waits. So each stage of compilation counts what it builds
against one ``CompileBudget`` and stops the moment a bound is passed, with an error that names
the bound:

    budget = CompileBudget()                     # the defaults below; a server may pass its own
    budget.count("nfa_states", len(nfa.edges))  # raises ConstraintTooLarge past the bound
    budget.check_time()                          # raises past the time bound

    stage                      bound                 counted
    schema -> regex            regex_length          each piece of the regex as it is written
                               nesting_depth         schemas inside schemas
    regex -> syntax tree       regex_length          the pattern given
                               nesting_depth         groups inside groups, while parsing
                               expanded_length       the characters the pattern stands for once its
                                                     counted repeats are unrolled: before any NFA
    tree -> NFA (chars, bytes) nfa_states            as states are added
    NFA -> DFA                 dfa_states            as subsets are discovered
    DFA x vocabulary -> index  token_index_bytes     as the trie walk fills the index, state by state
    all of them                seconds               the compiling thread's CPU time

Time is the compiling thread's CPU time (``time.thread_time``), not the wall clock: in a server
the compile shares the GIL and two cores with the engine, and a wall-clock bound would refuse a
schema there that compiles well within its bound on a quiet machine. The CPU time is the work
the constraint itself costs.

The defaults let every constraint of the test suites and the structured-output benchmark through
with a wide margin (its largest, ``ten_properties``: 797 regex characters, 2,519 DFA states, a
63 MB index, 0.3 s) and stop the attacks of issue 27 in well under a second each, by a size
bound, before the time bound is reached.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


class ConstraintTooLarge(ValueError):
    """A constraint needs more than its compile budget allows: the message names the bound."""

    def __init__(self, bound: str, limit: float, message: str | None = None, where: str = "the constraint"):
        self.bound, self.limit = bound, limit
        super().__init__(message or f"{where} is too large to compile: it needs more than {limit:g} "
                                    f"{bound.replace('_', ' ')} (the compile budget's {bound})")


DEFAULT_LIMITS = {
    "regex_length": 100_000,             # characters of a regex, given or written from a schema
    "nesting_depth": 100,                # groups inside groups of a regex, schemas inside schemas
    "expanded_length": 100_000,          # characters a regex stands for once its counted repeats are unrolled
    "nfa_states": 400_000,               # Thompson states, code points and then bytes
    "dfa_states": 20_000,
    "token_index_bytes": 128 << 20,      # one token index's arrays
    "seconds": 2.0,                      # CPU time of one compilation, all stages together
}


@dataclass
class CompileBudget:
    """Bounds for one compilation; ``count`` and ``check_time`` raise ``ConstraintTooLarge``."""
    limits: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_LIMITS))
    started: float | None = None   # the compiling thread's CPU clock at its first count: one thread per budget

    def count(self, bound: str, value: float, where: str = "the constraint") -> None:
        """Refuse as soon as ``value`` passes the bound's limit (and look at the clock too); ``where``
        names the part at fault in the message ("the schema at $.items")."""
        limit = self.limits[bound]
        if value > limit:
            raise ConstraintTooLarge(bound, limit, where=where)
        self.check_time()

    def check_time(self) -> None:
        limit, now = self.limits["seconds"], time.thread_time()
        if self.started is None:
            self.started = now
        if now - self.started > limit:
            raise ConstraintTooLarge("seconds", limit, f"the constraint took more than {limit:g} s of CPU time "
                                                       f"to compile (the compile budget's seconds): simplify it")
