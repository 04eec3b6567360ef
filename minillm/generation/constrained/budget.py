"""The compile budget: every constraint is compiled within bounds checked as it grows.

A constraint of a few bytes can ask for an automaton of billions of states (``(a{1000}){1000}``),
a schema of a kilobyte for a regex of megabytes (nested arrays double it per level). Checking
the size only at the end means paying for the blow-up first - seconds of one core and gigabytes
of memory while every other request waits. So each stage of compilation counts what it builds
against one ``CompileBudget`` and stops the moment a bound is passed, with an error that names
the bound:

    budget = CompileBudget()                     # the defaults below; a server may pass its own
    budget.count("nfa_states", len(nfa.edges))  # raises ConstraintTooLarge past the bound
    budget.check_time()                          # raises past the wall-time bound

The defaults let every constraint of the test suites and the structured-output benchmark through
with a wide margin and stop the attacks of issue 27 within about a second.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


class ConstraintTooLarge(ValueError):
    """A constraint needs more than its compile budget allows: the message names the bound."""

    def __init__(self, bound: str, limit: float, message: str | None = None):
        self.bound, self.limit = bound, limit
        super().__init__(message or f"the constraint is too large to compile: it needs more than "
                                    f"{limit:g} {bound.replace('_', ' ')}")


DEFAULT_LIMITS = {
    "regex_length": 100_000,             # characters of a regex after schema expansion
    "expanded_repeats": 100_000,         # characters a regex stands for once its counted repeats are unrolled
    "nfa_states": 200_000,
    "dfa_states": 20_000,
    "grammar_rules": 20_000,             # rules of a grammar after schema expansion
    "token_index_bytes": 256 << 20,      # one token index's arrays
    "seconds": 1.0,                      # wall time of one compilation, all stages together
}


@dataclass
class CompileBudget:
    """Bounds for one compilation; ``count`` and ``check_time`` raise ``ConstraintTooLarge``."""
    limits: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_LIMITS))
    started: float = field(default_factory=time.perf_counter)

    def count(self, bound: str, value: float) -> None:
        """Refuse as soon as ``value`` passes the bound's limit (and look at the clock too)."""
        limit = self.limits[bound]
        if value > limit:
            raise ConstraintTooLarge(bound, limit)
        self.check_time()

    def check_time(self) -> None:
        limit = self.limits["seconds"]
        if time.perf_counter() - self.started > limit:
            raise ConstraintTooLarge("seconds", limit, f"the constraint took more than {limit:g} s to compile "
                                                       f"(the compile budget): simplify it")
