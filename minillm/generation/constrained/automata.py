"""Regex -> NFA (Thompson) -> DFA (subset construction) -> minimal DFA, over any integer alphabet.

Symbols are integers and edges carry ranges of them, so the same three constructions serve two
alphabets: Unicode code points (the DFA a person reads, chapter 11's drawings) and bytes (the DFA
the token index walks: tokens of a byte-level BPE are byte strings, and one may end in the middle
of a character). ``utf8_nfa`` rewrites a code-point NFA into a byte NFA by replacing each
character range with the UTF-8 byte sequences that encode it.

    nfa = thompson(parse(r"a[bc]*"))     # code points
    dfa = minimize(determinize(nfa))     # the fewest states that accept the same language
    dfa.fullmatch("abcb")                # True, exactly when re.fullmatch agrees
    byte_dfa = compile_byte_dfa(r"a[bc]*")   # the same language, one byte at a time

Subset construction can blow up exponentially, and a counted repeat copies its node: every stage
counts what it builds against a ``CompileBudget`` (budget.py) and stops with ``ConstraintTooLarge``
naming the bound - NFA states as they are added, DFA states as they are discovered, the CPU time
while it refines - instead of hanging or filling the memory first.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from minillm.generation.constrained.budget import CompileBudget
from minillm.generation.constrained.regex import Alternate, Chars, Concat, Repeat, parse

DEAD = -1                # the transition to "no match possible any more"
COUNT_EVERY = 1024       # NFA states are counted against the budget once per this many (each count reads a clock)


# -----------------------------------------------------------------------------------------------
# NFA: Thompson's construction


@dataclass
class NFA:
    """States 0..n-1; ``edges[s]`` holds (lo, hi, target) symbol-range moves, ``eps[s]`` the targets
    reached without reading anything. One start, one accepting state. States are counted against
    ``budget`` as they are added."""
    edges: list[list[tuple[int, int, int]]] = field(default_factory=list)
    eps: list[list[int]] = field(default_factory=list)
    start: int = 0
    accept: int = 0
    budget: CompileBudget = field(default_factory=CompileBudget, repr=False)

    def add_state(self) -> int:
        self.edges.append([])
        self.eps.append([])
        if len(self.edges) % COUNT_EVERY == 0:
            self.budget.count("nfa_states", len(self.edges))
        return len(self.edges) - 1

    @property
    def num_states(self) -> int:
        return len(self.edges)


def thompson(node, budget: CompileBudget | None = None) -> NFA:
    """Thompson's construction: every node becomes a fragment with one entry and one exit state,
    and fragments are wired together with epsilon moves."""
    nfa = NFA(budget=CompileBudget() if budget is None else budget)
    nfa.start, nfa.accept = _fragment(nfa, node)
    return nfa


def _fragment(nfa: NFA, node) -> tuple[int, int]:
    """Add `node`'s states to `nfa`; return its (entry, exit)."""
    if isinstance(node, Chars):
        entry, exit_ = nfa.add_state(), nfa.add_state()
        nfa.edges[entry].extend((lo, hi, exit_) for lo, hi in node.ranges)
        return entry, exit_
    if isinstance(node, Concat):
        entry = exit_ = nfa.add_state()
        for part in node.parts:
            a, b = _fragment(nfa, part)
            nfa.eps[exit_].append(a)
            exit_ = b
        return entry, exit_
    if isinstance(node, Alternate):
        entry, exit_ = nfa.add_state(), nfa.add_state()
        for option in node.options:
            a, b = _fragment(nfa, option)
            nfa.eps[entry].append(a)
            nfa.eps[b].append(exit_)
        return entry, exit_
    if isinstance(node, Repeat):
        # x{lo,hi} = lo copies of x, then (hi - lo) optional copies, or a star if hi is None.
        entry = exit_ = nfa.add_state()
        for _ in range(node.lo):
            a, b = _fragment(nfa, node.node)
            nfa.eps[exit_].append(a)
            exit_ = b
        if node.hi is None:                     # star: loop back, or skip
            a, b = _fragment(nfa, node.node)
            nfa.eps[exit_].append(a)
            nfa.eps[b].append(a)
            end = nfa.add_state()
            nfa.eps[exit_].append(end)
            nfa.eps[b].append(end)
            return entry, end
        end = nfa.add_state()
        for _ in range(node.hi - node.lo):      # each optional copy may be the last
            nfa.eps[exit_].append(end)
            a, b = _fragment(nfa, node.node)
            nfa.eps[exit_].append(a)
            exit_ = b
        nfa.eps[exit_].append(end)
        return entry, end
    raise TypeError(f"not a regex node: {node!r}")


# -----------------------------------------------------------------------------------------------
# Code points -> UTF-8 bytes


def utf8_sequences(lo: int, hi: int) -> list[list[tuple[int, int]]]:
    """The code points lo..hi as a list of byte-range sequences: a code point (not a surrogate) is in
    lo..hi exactly when its UTF-8 encoding matches one sequence (one byte range per byte)."""
    out = []
    # same encoded length within each piece; the surrogates D800-DFFF have no UTF-8 encoding
    for limit_lo, limit_hi in ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF)):
        a, b = max(lo, limit_lo), min(hi, limit_hi)
        if a <= b:
            _split_same_length(a, b, out)
    return out


def _split_same_length(a: int, b: int, out: list) -> None:
    n = len(chr(a).encode("utf-8"))
    # A range is one byte-range sequence when, for each trailing byte, it spans either a single
    # value or the whole continuation range 0x80..0xBF. Split until that holds.
    for i in range(1, n):
        mask = (1 << (6 * i)) - 1            # the bits of the last i continuation bytes
        if a & ~mask != b & ~mask:           # a and b differ above those bytes
            if a & mask:                     # a does not start a full block: peel its partial block
                _split_same_length(a, a | mask, out)
                _split_same_length((a | mask) + 1, b, out)
                return
            if b & mask != mask:             # b does not end a full block
                _split_same_length(a, (b & ~mask) - 1, out)
                _split_same_length(b & ~mask, b, out)
                return
    out.append(list(zip(chr(a).encode("utf-8"), chr(b).encode("utf-8"))))


def utf8_nfa(nfa: NFA) -> NFA:
    """The same language, read one UTF-8 byte at a time: each code-point range edge becomes chains
    of byte-range edges (sharing the states that its chains share would be a further saving)."""
    out = NFA(eps=[list(e) for e in nfa.eps], edges=[[] for _ in nfa.edges], start=nfa.start, accept=nfa.accept,
              budget=nfa.budget)
    for s, edges in enumerate(nfa.edges):
        for lo, hi, target in edges:
            for seq in utf8_sequences(lo, hi):
                at = s
                for k, (blo, bhi) in enumerate(seq):
                    nxt = target if k == len(seq) - 1 else out.add_state()
                    out.edges[at].append((blo, bhi, nxt))
                    at = nxt
    return out


# -----------------------------------------------------------------------------------------------
# DFA


@dataclass
class DFA:
    """A deterministic automaton over integer symbols.

    The alphabet is cut into classes, intervals [boundaries[k], boundaries[k+1]) of symbols that
    every state treats alike; ``table[state, class]`` is the next state or DEAD. Start is state 0.
    """
    boundaries: np.ndarray   # (C,) int64, the first symbol of each class; boundaries[0] == 0
    table: np.ndarray        # (S, C) int32
    accepting: np.ndarray    # (S,) bool

    @property
    def num_states(self) -> int:
        return self.table.shape[0]

    def symbol_class(self, symbol: int) -> int:
        return bisect.bisect_right(self.boundaries, symbol) - 1

    def step(self, state: int, symbol: int) -> int:
        return DEAD if state == DEAD else int(self.table[state, self.symbol_class(symbol)])

    def walk(self, symbols, state: int = 0) -> int:
        for s in symbols:
            state = self.step(state, s)
            if state == DEAD:
                break
        return state

    def fullmatch(self, text: str | bytes) -> bool:
        """Accepts `text` (code points for a character DFA, bytes for a byte DFA)."""
        symbols = text if isinstance(text, bytes) else map(ord, text)
        state = self.walk(symbols)
        return state != DEAD and bool(self.accepting[state])

    def class_ranges(self, k: int) -> tuple[int, int]:
        """The symbols of class k, as an inclusive range."""
        hi = int(self.boundaries[k + 1]) - 1 if k + 1 < len(self.boundaries) else MAX_SYMBOL
        return int(self.boundaries[k]), hi

    def longest_match(self) -> int | None:
        """The most symbols of an accepted text; None when there is no most (the language is infinite).

        In a minimal DFA every state is reachable and can still reach acceptance, so the language
        is finite exactly when the moves have no cycle; then the answer is the longest path from
        the start to an accepting state, found in topological order (Kahn's algorithm). For a DFA
        that is not minimal a cycle among useless states also gives None: never a wrong bound."""
        num_states = self.num_states
        sources, classes = np.nonzero(self.table >= 0)
        pairs = np.unique(sources.astype(np.int64) * num_states + self.table[sources, classes])   # each move once
        sources, targets = np.divmod(pairs, num_states)
        first = np.searchsorted(sources, np.arange(num_states + 1))
        indegree = np.bincount(targets, minlength=num_states)
        targets = targets.tolist()
        longest = [-1] * num_states   # the longest path from the start, -1: none
        longest[0] = 0
        ready, done = [s for s in range(num_states) if indegree[s] == 0], 0
        while ready:
            s = ready.pop()
            done += 1
            for t in targets[first[s]:first[s + 1]]:
                if longest[s] >= 0:
                    longest[t] = max(longest[t], longest[s] + 1)
                indegree[t] -= 1
                if indegree[t] == 0:
                    ready.append(t)
        if done < num_states:   # a cycle
            return None
        return max((longest[s] for s in np.flatnonzero(self.accepting)), default=0)

    def byte_table(self) -> np.ndarray:
        """(S, 256) next state per byte value: the class lookup done once, for a byte DFA."""
        classes = np.searchsorted(self.boundaries, np.arange(256), side="right") - 1   # (256,)
        return self.table[:, classes]


MAX_SYMBOL = 0x10FFFF


def _epsilon_closure(nfa: NFA, states) -> frozenset[int]:
    seen, stack = set(states), list(states)
    while stack:
        for t in nfa.eps[stack.pop()]:
            if t not in seen:
                seen.add(t)
                stack.append(t)
    return frozenset(seen)


def determinize(nfa: NFA) -> DFA:
    """Subset construction: a DFA state is the set of NFA states the input could have reached.

    The alphabet classes come from the NFA's edge ends: between two consecutive ends every symbol
    moves every NFA state alike, so the DFA only needs one column per class. Each new state is
    counted against the NFA's budget (``dfa_states``), and each row looks at the clock."""
    budget = nfa.budget
    cuts = sorted({0} | {lo for e in nfa.edges for lo, _, _ in e} | {hi + 1 for e in nfa.edges for _, hi, _ in e})
    boundaries = np.array([c for c in cuts if c <= MAX_SYMBOL], dtype=np.int64)
    index = {int(c): k for k, c in enumerate(boundaries)}
    # each NFA edge as the run of classes it covers: (first class, last class, target)
    moves = [[(index[lo], (index[hi + 1] if hi + 1 in index else len(boundaries)) - 1, t) for lo, hi, t in e]
             for e in nfa.edges]
    start = _epsilon_closure(nfa, [nfa.start])
    ids, order, rows = {start: 0}, [start], []
    reached: dict[frozenset[int], int] = {}   # the DFA state a set of move targets leads to: one closure per set
    while len(rows) < len(order):
        current = order[len(rows)]
        budget.check_time()
        targets: dict[int, set[int]] = {}
        for s in current:
            for c_lo, c_hi, t in moves[s]:
                for c in range(c_lo, c_hi + 1):
                    targets.setdefault(c, set()).add(t)
        row = [DEAD] * len(boundaries)
        for c, ts in targets.items():
            key = frozenset(ts)
            if key not in reached:
                nxt = _epsilon_closure(nfa, ts)
                if nxt not in ids:
                    budget.count("dfa_states", len(ids) + 1)
                    ids[nxt] = len(order)
                    order.append(nxt)
                reached[key] = ids[nxt]
            row[c] = reached[key]
        rows.append(row)
    accepting = np.array([nfa.accept in s for s in order])
    return DFA(boundaries, np.array(rows, dtype=np.int32).reshape(len(order), len(boundaries)), accepting)


def minimize(dfa: DFA, budget: CompileBudget | None = None) -> DFA:
    """The minimal DFA of the same language (Moore's partition refinement).

    First drop the states from which no accepting state can be reached (their moves become DEAD,
    so a DEAD transition always means "this prefix cannot be completed"). Then split blocks of
    states until all states of a block agree on acceptance and on the block each class leads to;
    each final block is one state. Classes whose columns end up identical are merged, and states
    are numbered in breadth-first order from the start. Each round of refinement looks at the
    budget's clock: there may be as many rounds as states."""
    budget = CompileBudget() if budget is None else budget
    table, accepting = dfa.table, dfa.accepting
    live = _coreachable(table, accepting)
    if not live[0]:   # the language is empty: one state, rejecting everything
        return DFA(np.zeros(1, dtype=np.int64), np.full((1, 1), DEAD, dtype=np.int32), np.zeros(1, dtype=bool))
    num_states = len(table)
    table = np.where((table >= 0) & live[np.maximum(table, 0)], table, DEAD)
    # A state's signature is its own block, then the block of each class's target. One gather
    # makes it: column 0 points at the state itself, a DEAD move at one past the last state, whose
    # block stays DEAD. Blocks are int32: signatures half the size of int64 ones made the whole
    # refinement about 3x faster (10-property schema: 4848 states x 69 columns, 44 rounds).
    looked_up = np.concatenate([np.arange(num_states)[:, None], np.where(table >= 0, table, num_states)],
                               axis=1)                                                # (S, 1 + C)
    block_of = np.full(num_states + 1, DEAD, dtype=np.int32)                      # (S+1,) block per state, then DEAD
    block_of[:num_states] = _number_rows(accepting[:, None])                         # first split: accepting or not
    num_blocks = int(block_of.max()) + 1
    while True:  # refinement only ever splits blocks: an unchanged count means nothing split
        budget.check_time()
        new_block = _number_rows(block_of[looked_up])                                 # signatures (S, 1 + C)
        if new_block.max() + 1 == num_blocks:
            break
        block_of[:num_states], num_blocks = new_block, int(new_block.max()) + 1
    block = block_of[:num_states]
    # One representative per block, its first state. A block is all live or all dead (the dead
    # states are the one block that rejects and moves nowhere), and no live move enters the dead
    # block, so the walk from the start below never meets it.
    _, reps = np.unique(block, return_index=True)                                    # (B,)
    block_table = block_of[looked_up[reps, 1:]]                                      # (B, C) moves between blocks
    # number the blocks reachable from the start in breadth-first order
    rows = block_table.tolist()
    order, number = [int(block[0])], {int(block[0]): 0}
    for b in order:
        for t in rows[b]:
            if t >= 0 and t not in number:
                number[t] = len(order)
                order.append(t)
    renumber = np.full(num_blocks, DEAD, dtype=np.int32)
    renumber[list(number)] = list(number.values())
    kept = block_table[order]                                                         # (S', C)
    new_table = np.where(kept >= 0, renumber[np.maximum(kept, 0)], DEAD).astype(np.int32)
    new_accepting = accepting[reps[order]]
    return _merge_classes(DFA(dfa.boundaries, new_table, new_accepting))


def _number_rows(rows: np.ndarray) -> np.ndarray:
    """(R,) int32: equal rows get equal numbers, different rows different ones. Sorted (by every
    column: lexsort), equal rows sit together; a new number starts wherever a row differs from
    the one before it."""
    order = np.lexsort(rows.T)                                                       # (R,)
    ranked = rows[order]
    starts = np.ones(len(rows), dtype=np.int32)
    starts[1:] = (ranked[1:] != ranked[:-1]).any(axis=1)
    numbers = np.empty(len(rows), dtype=np.int32)
    numbers[order] = np.cumsum(starts, dtype=np.int32) - 1
    return numbers


def _coreachable(table: np.ndarray, accepting: np.ndarray) -> np.ndarray:
    """(S,) bool: an accepting state can be reached from the state. A search from the accepting
    states along the moves read backwards."""
    num_states = table.shape[0]
    sources, classes = np.nonzero(table >= 0)
    # each (target, source) pair once, sorted by target: the moves into t are first[t]..first[t+1]
    pairs = np.unique(table[sources, classes].astype(np.int64) * num_states + sources)
    targets, sources = np.divmod(pairs, num_states)
    first = np.searchsorted(targets, np.arange(num_states + 1))
    sources = sources.tolist()
    live = accepting.copy()
    stack = np.flatnonzero(accepting).tolist()
    while stack:
        t = stack.pop()
        for s in sources[first[t]:first[t + 1]]:
            if not live[s]:
                live[s] = True
                stack.append(s)
    return live


def _merge_classes(dfa: DFA) -> DFA:
    """Adjacent classes with identical columns become one class."""
    keep = [0] + [k for k in range(1, dfa.table.shape[1]) if not (dfa.table[:, k] == dfa.table[:, k - 1]).all()]
    return DFA(dfa.boundaries[keep], np.ascontiguousarray(dfa.table[:, keep]), dfa.accepting)


@lru_cache(maxsize=64)
def compile_dfa(pattern: str) -> DFA:
    """The minimal DFA over code points: what a person reads and draws (the default budget)."""
    budget = CompileBudget()
    return minimize(determinize(thompson(parse(pattern, budget), budget)), budget)


def byte_dfa(pattern: str, budget: CompileBudget | None = None) -> DFA:
    """The minimal DFA over the UTF-8 bytes of the text: what the token index walks."""
    budget = CompileBudget() if budget is None else budget
    return minimize(determinize(utf8_nfa(thompson(parse(pattern, budget), budget))), budget)


@lru_cache(maxsize=64)
def compile_byte_dfa(pattern: str) -> DFA:
    """``byte_dfa`` with the default budget, cached: for reading and drawing (each token index
    holds its own DFA, in the bounded index cache)."""
    return byte_dfa(pattern)
