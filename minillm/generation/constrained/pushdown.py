"""A grammar's rule DFAs as one pushdown automaton over bytes.

Every rule DFA's states are numbered into one global range, so that a position in the grammar is
one integer ``g`` and its byte moves are one row of a (G, 256) table. A move on a rule symbol
becomes a *call*: from g, rule R may start (at R's start state) and, once R's text is complete,
the walk goes on at the state the symbol's move led to - the *return state*, kept on a stack.

    configuration   (g, stack)  stack: a tuple of return states, innermost last
    read byte b     from every configuration reachable from (g, stack) without reading (calls push
                    a return state; a state where its rule may end pops one), take g's move on b

The grammar may be ambiguous (a property that is optional or not, ``anyOf`` options that start
alike), so a parse is a *set* of configurations, as in llama.cpp's grammar: for the grammars
JSON Schema gives, the set stays a handful. Stacks are tuples: immutable, so configurations are
hashable (the mask cache is keyed by them) and a push shares nothing mutable.

A rule that can call itself before reading a byte (left recursion) would push forever: it is
refused when the automaton is built.

Arrays with ``uniqueItems`` are read as any other rule here (duplicates pass): ``unique`` lists
them for unique_items.py, which the guide runs beside this automaton.

Closing: ``close_bytes[g]`` is the fewest bytes that finish g's rule (the called rules' shortest
texts included), found by relaxing every move until nothing shrinks; a configuration needs
close_bytes[g] + the sum over its stack, and ``closing_text`` spells one shortest completion.
"""
from __future__ import annotations

import numpy as np

from minillm.generation.constrained.automata import DEAD
from minillm.generation.constrained.budget import CompileBudget
from minillm.generation.constrained.grammar import REF_BASE, Grammar, GrammarError, compile_rules

UNREACHABLE = np.iinfo(np.int64).max // 4
Config = tuple[int, tuple[int, ...]]


class Pushdown:
    """The global byte table, the call edges and the closing lengths of one grammar."""

    def __init__(self, grammar: Grammar, budget: CompileBudget | None = None):
        names, dfas = compile_rules(grammar, budget)
        self.rule_names = names
        self.unique = {names.index(n): spec for n, spec in grammar.unique.items() if n in names}   # rule -> UniqueItems
        self.rule_start = np.cumsum([0] + [d.num_states for d in dfas])[:-1].astype(np.int32)   # (R,)
        num_states = int(sum(d.num_states for d in dfas))
        table = np.full((num_states, 256), DEAD, dtype=np.int32)                                 # (G, 256)
        accepting = np.zeros(num_states, dtype=bool)                                            # (G,)
        calls: list[list[tuple[int, int]]] = [[] for _ in range(num_states)]
        ref_symbols = REF_BASE + np.arange(len(names))
        for r, dfa in enumerate(dfas):
            base = int(self.rule_start[r])
            local = dfa.byte_table()                                                             # (S, 256)
            table[base:base + dfa.num_states] = np.where(local >= 0, local + base, DEAD)
            accepting[base:base + dfa.num_states] = dfa.accepting
            classes = np.searchsorted(dfa.boundaries, ref_symbols, side="right") - 1             # (R,)
            moves = dfa.table[:, classes]                                                        # (S, R)
            for s, callee in zip(*np.nonzero(moves >= 0)):
                calls[base + s].append((int(self.rule_start[callee]), base + int(moves[s, callee])))
        self.table, self.accepting, self.calls = table, accepting, calls
        self.call_offsets = np.cumsum([0] + [len(c) for c in calls]).astype(np.int64)            # (G+1,)
        self.call_targets = np.array([t for c in calls for t, _ in c], dtype=np.int32)           # (C,)
        self.call_returns = np.array([r for c in calls for _, r in c], dtype=np.int32)           # (C,)
        self.start = int(self.rule_start[0])
        self.close_bytes = self._closing_lengths()
        if self.close_bytes[self.start] >= UNREACHABLE:
            raise GrammarError("the grammar's language is empty: no text is ever complete")
        self._trim()
        self._refuse_left_recursion()

    def _trim(self) -> None:
        """Cut every move into a state that can never finish its rule: then a byte is allowed
        only if the text can still be completed, which is what a mask must promise."""
        dead = self.close_bytes >= UNREACHABLE                                         # (G,)
        self.table = np.where((self.table >= 0) & ~dead[np.maximum(self.table, 0)], self.table, DEAD).astype(np.int32)
        self.calls = [[(t, r) for t, r in c if not dead[t] and not dead[r]] for c in self.calls]
        self.call_offsets = np.cumsum([0] + [len(c) for c in self.calls]).astype(np.int64)
        self.call_targets = np.array([t for c in self.calls for t, _ in c], dtype=np.int32)
        self.call_returns = np.array([r for c in self.calls for _, r in c], dtype=np.int32)

    @property
    def num_states(self) -> int:
        return self.table.shape[0]

    # ---- closing lengths ------------------------------------------------------------------

    def _closing_lengths(self) -> np.ndarray:
        """(G,) int64 the fewest bytes from each state to its rule's end (Bellman-Ford on the moves)."""
        close = np.where(self.accepting, 0, UNREACHABLE).astype(np.int64)
        sources, columns = np.nonzero(self.table >= 0)
        pairs = np.unique(sources.astype(np.int64) * self.num_states + self.table[sources, columns])
        byte_from, byte_to = np.divmod(pairs, self.num_states)           # each (state, next state) once
        call_from = np.repeat(np.arange(self.num_states), np.diff(self.call_offsets))
        while True:
            new = close.copy()
            np.minimum.at(new, byte_from, np.minimum(close[byte_to] + 1, UNREACHABLE))
            if len(call_from):
                np.minimum.at(new, call_from, np.minimum(close[self.call_targets] + close[self.call_returns],
                                                         UNREACHABLE))
            if (new == close).all():
                return close
            close = new

    def closing_cost(self, config: Config) -> int:
        g, stack = config
        return int(self.close_bytes[g] + sum(int(self.close_bytes[r]) for r in stack))

    def closing_text(self, config: Config) -> bytes:
        """One shortest text that completes `config` (every open rule finished, the stack emptied)."""
        g, stack = config
        out = bytearray()
        while True:
            need = self.close_bytes[g]
            if need == 0:                              # this rule may end here: return
                if not stack:
                    return bytes(out)
                g, stack = stack[-1], stack[:-1]
                continue
            row = self.table[g]
            live = np.flatnonzero((row >= 0) & (self.close_bytes[np.maximum(row, 0)] == need - 1))
            if len(live):
                out.append(int(live[0]))
                g = int(row[live[0]])
                continue
            for callee, ret in self.calls[g]:
                if self.close_bytes[callee] + self.close_bytes[ret] == need:
                    g, stack = callee, stack + (ret,)
                    break

    # ---- reading ------------------------------------------------------------------------

    def reading(self, configs) -> set[Config]:
        """Every configuration reachable from `configs` by calls and returns, reading nothing."""
        seen, todo = set(), list(configs)
        while todo:
            config = todo.pop()
            if config in seen:
                continue
            seen.add(config)
            g, stack = config
            for callee, ret in self.calls[g]:
                todo.append((callee, stack + (ret,)))
            if self.accepting[g] and stack:
                todo.append((stack[-1], stack[:-1]))
        return seen

    def step(self, configs, byte: int) -> set[Config]:
        """The configurations after reading `byte`; empty: the byte is not allowed."""
        out = set()
        for g, stack in self.reading(configs):
            t = int(self.table[g, byte])
            if t != DEAD:
                out.add((t, stack))
        return out

    def walk(self, data: bytes, configs=None) -> set[Config]:
        configs = {(self.start, ())} if configs is None else configs
        for b in data:
            configs = self.step(configs, b)
            if not configs:
                break
        return configs

    def can_end(self, configs) -> bool:
        """Some configuration is complete: its rules all end here, nothing left on the stack."""
        return any(self.accepting[g] and not stack for g, stack in self.reading(configs))

    def fullmatch(self, data: bytes) -> bool:
        return self.can_end(self.walk(data))

    def next_bytes(self, configs) -> np.ndarray:
        """(K,) the byte values that may come next."""
        live = np.zeros(256, dtype=bool)
        for g, _ in self.reading(configs):
            live |= self.table[g] >= 0
        return np.flatnonzero(live)

    # ---- left recursion -----------------------------------------------------------------

    def _refuse_left_recursion(self) -> None:
        """A rule that reaches a call of itself without reading a byte would push without end."""
        nullable = self.close_bytes[self.rule_start] == 0                              # (R,)
        rule_of = {int(s): r for r, s in enumerate(self.rule_start)}
        first_calls: list[set[int]] = []
        for r, start in enumerate(self.rule_start):
            seen, todo, called = set(), [int(start)], set()
            while todo:   # states reachable from the start through calls of rules that may be empty
                g = todo.pop()
                if g in seen:
                    continue
                seen.add(g)
                for callee, ret in self.calls[g]:
                    called.add(rule_of[callee])
                    if nullable[rule_of[callee]]:
                        todo.append(ret)
            first_calls.append(called)
        for r in range(len(self.rule_start)):   # is r reachable from itself in the first-call graph?
            seen, todo = set(), list(first_calls[r])
            while todo:
                q = todo.pop()
                if q == r:
                    raise GrammarError(f"rule {self.rule_names[r]!r} is left-recursive: it can call itself "
                                       f"before reading anything")
                if q not in seen:
                    seen.add(q)
                    todo.extend(first_calls[q])
