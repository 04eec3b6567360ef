"""Byte DFAs built from a syntax tree, intersected and complemented: the languages a regex cannot
spell but two DFAs can (a string both matching a pattern and at most 20 characters long; a key
that is none of the declared property names).

    byte_dfa(tree)           the minimal byte DFA of a code-point syntax tree
    intersect(a, b)          the product automaton: accepts what both accept
    complement(a)            accepts every byte string `a` rejects
    union(a, b)              accepts what either accepts (De Morgan over the two above)
"""
from __future__ import annotations

import numpy as np

from minillm.generation.constrained.automata import DEAD, DFA, determinize, minimize, thompson, utf8_nfa
from minillm.generation.constrained.budget import CompileBudget

BYTES = np.arange(256, dtype=np.int64)   # one symbol class per byte value


def byte_dfa(tree, budget: CompileBudget | None = None) -> DFA:
    nfa = utf8_nfa(thompson(tree))
    if budget is not None:
        budget.count("nfa_states", nfa.num_states)
    dfa = minimize(determinize(nfa))
    if budget is not None:
        budget.count("dfa_states", dfa.num_states)
    return dfa


def table_dfa(table: np.ndarray, accepting) -> DFA:
    """A DFA with one class per byte value, minimized."""
    return minimize(DFA(BYTES.copy(), np.ascontiguousarray(table, dtype=np.int32), np.asarray(accepting, dtype=bool)))


def intersect(a: DFA, b: DFA, budget: CompileBudget | None = None) -> DFA:
    """The product of two byte DFAs, built from the start pair outwards (only reachable pairs)."""
    ta, tb = a.byte_table(), b.byte_table()                                 # (Sa, 256), (Sb, 256)
    ids, order, rows = {(0, 0): 0}, [(0, 0)], []
    while len(rows) < len(order):
        sa, sb = order[len(rows)]
        na, nb = ta[sa], tb[sb]
        row = np.full(256, DEAD, dtype=np.int32)
        for byte in np.flatnonzero((na >= 0) & (nb >= 0)):
            pair = (int(na[byte]), int(nb[byte]))
            if pair not in ids:
                ids[pair] = len(order)
                order.append(pair)
                if budget is not None:
                    budget.count("dfa_states", len(order))
            row[byte] = ids[pair]
        rows.append(row)
    accepting = [bool(a.accepting[x]) and bool(b.accepting[y]) for x, y in order]
    return table_dfa(np.stack(rows), accepting)


def complement(a: DFA) -> DFA:
    """Every byte string `a` rejects: DEAD becomes a sink state, acceptance flips."""
    table = a.byte_table()                                                   # (S, 256)
    sink = table.shape[0]
    full = np.vstack([np.where(table >= 0, table, sink), np.full((1, 256), sink)])
    return table_dfa(full, np.append(~a.accepting, True))


def union(a: DFA, b: DFA, budget: CompileBudget | None = None) -> DFA:
    """Every byte string `a` or `b` accepts."""
    return complement(intersect(complement(a), complement(b), budget))
