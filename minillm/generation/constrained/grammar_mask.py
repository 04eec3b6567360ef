"""Token masks of a pushdown automaton: a per-state cache of what the stack cannot change.

For a DFA the allowed tokens depend on the state alone, and token_index.py lists them once per
state. Under a pushdown automaton they depend on the stack too - but for most tokens only in
appearance (XGrammar's observation). Take the top state g and pretend the stack below it is
unknown. Walking a token's bytes from g either

    stays inside: every byte is read by g's rule or by rules it calls -> allowed, whatever the stack
    dies inside: no path survives, none ever needed the unknown part -> masked, whatever the stack
    pops below: some path finishes g's rule and reads on in the caller -> depends on the stack

The first two are *context-independent*: found once per state by a walk of the vocabulary trie
(token_index.py's trie, the same skipping of dead subtrees), with the automaton's calls and returns
inside the walk. Only the third kind is checked against the real stack at each step, token by
token - inside a JSON string that is the few hundred tokens holding a closing quote followed by
more bytes (``",``, ``"}``), not the 49k others. Where the stack decides for most of the
vocabulary (right after a number, which any byte but a digit ends), one walk of the trie with
the real stack costs less than checking the tokens one by one, and is taken instead.

    index = GrammarIndex(pushdown, tokenizer)
    index.allowed(configs)   # (K,) sorted ids; cached per set of configurations

A configuration set repeats often (every token inside one string value), so the mask of a set is
kept in a small LRU cache too. The walks are Numba loops over fixed-size arrays: at most
MAX_CONFIGS configurations per byte and MAX_PUSHES rules entered within one token; a path past
those bounds is dropped, which can only mask a token out, never let a wrong one through.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
from numba import njit

from minillm.generation.constrained.pushdown import Pushdown
from minillm.generation.constrained.token_index import vocabulary_trie
from minillm.generation.constrained.unique_items import Uniqueness, Vocabulary
from minillm.generation.tokenizer import Tokenizer

MAX_CONFIGS = 32     # configurations alive after one byte
MAX_PUSHES = 24      # return states one token may push
MASK_CACHE = 4096    # masks of configuration sets kept per index
RECHECK_LIMIT = 2048  # past this many stack-dependent tokens, walk the trie with the real stack instead


class GrammarIndex:
    """One grammar's masks over one tokenizer's vocabulary."""

    # The longest text the grammar admits, for the admission check of min_tokens (guide.min_tokens_problem):
    # not computed for grammars, so that check is left to the run time (a stuck sequence ends alone).
    longest_text = None

    def __init__(self, pushdown: Pushdown, tokenizer: Tokenizer):
        self.pushdown, self.tokenizer = pushdown, tokenizer
        self.eos_id = tokenizer.eos_id
        self.trie = vocabulary_trie(tokenizer)
        data = [tokenizer.id_to_bytes[t] for t in range(tokenizer.vocab_size)]
        self.token_offsets = np.cumsum([0] + [len(d) for d in data]).astype(np.int64)             # (V+1,)
        self.token_bytes = np.frombuffer(b"".join(data), dtype=np.uint8).copy()                # (total,)
        self.max_depth = int(self.trie.depth.max())
        excluded = set(tokenizer.added_ids) | set(tokenizer.special_ids)
        self._byte_tokens = {d[0]: t for t, d in enumerate(data) if len(d) == 1 and t not in excluded}
        # uniqueItems arrays: checked beside these masks, token by token where it matters (unique_items.py)
        self.uniqueness = Uniqueness(pushdown) if pushdown.unique else None
        self.unique_vocabulary = Vocabulary(tokenizer, data, self.trie, pushdown.unique) if pushdown.unique else None
        self._per_state: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._masks: OrderedDict = OrderedDict()
        # The first mask, made now: the server builds an index in its compile thread, so the engine
        # thread's first step finds it (on a cold Numba cache this also compiles the walks: ~6 s).
        self.allowed_with_costs(frozenset({(pushdown.start, ())}))
        check_tokens(*self._arrays(), pushdown.start, np.zeros(0, dtype=np.int32), np.zeros(1, dtype=np.int64),
                     np.zeros(0, dtype=np.int64), self.token_offsets, self.token_bytes)

    def byte_token(self, value: int) -> int:
        """The token of the single byte `value` (byte-level BPE has one for every byte)."""
        return self._byte_tokens[value]

    def split(self, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """State g's tokens allowed whatever the stack (sorted ids, and the closing bytes after each,
        the stack's own left out), and the sorted ids that depend on the stack."""
        if g not in self._per_state:
            self._per_state[g] = self._walk(g, ())
        return self._per_state[g]

    def _walk(self, g: int, stack: tuple[int, ...]):
        t = self.trie
        real = np.array(stack, dtype=np.int32)
        return trie_walk(*self._arrays(), g, real, self._stack_costs(real), t.parent, t.byte, t.depth,
                         t.subtree_end, t.token_starts, t.token_ids, self.tokenizer.vocab_size, self.max_depth)

    def _stack_costs(self, real: np.ndarray) -> np.ndarray:
        """(len+1,) the closing bytes of the stack's first b return states, for every b."""
        return np.concatenate([[0], np.cumsum(self.pushdown.close_bytes[real])]).astype(np.int64)

    def allowed(self, configs) -> np.ndarray:
        """(K,) sorted ids allowed from the configuration set (EOS where a parse may end)."""
        return self.allowed_with_costs(configs)[0]

    def allowed_with_costs(self, configs) -> tuple[np.ndarray, np.ndarray]:
        """(K,) sorted allowed ids and (K,) the fewest bytes that close the text after each; cached."""
        key = frozenset(configs)
        entry = self._masks.get(key)
        if entry is not None:
            self._masks.move_to_end(key)
            return entry
        ids, costs = [], []
        for g, stack in configs:
            real = np.array(stack, dtype=np.int32)
            real_cost = self._stack_costs(real)
            independent, local_costs, dependent = self.split(g)
            if len(dependent) > RECHECK_LIMIT:   # most of the vocabulary: one walk with the real stack is faster
                walked, walked_costs, _ = self._walk(g, stack)
                ids.append(walked)
                costs.append(walked_costs)
                continue
            ids.append(independent)
            costs.append(local_costs + real_cost[-1])
            if len(dependent):
                ok, cost = check_tokens(*self._arrays(), g, real, real_cost, dependent, self.token_offsets,
                                        self.token_bytes)
                ids.append(dependent[ok])
                costs.append(cost[ok])
        if self.eos_id is not None and self.pushdown.can_end(configs):
            ids.append(np.array([self.eos_id], dtype=np.int64))
            costs.append(np.zeros(1, dtype=np.int64))
        ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        costs = np.concatenate(costs) if costs else np.zeros(0, dtype=np.int64)
        order = np.lexsort((costs, ids))                     # by id, the cheapest first
        ids, costs = ids[order], costs[order]
        first = np.r_[True, ids[1:] != ids[:-1]] if len(ids) else np.zeros(0, dtype=bool)
        entry = (ids[first], costs[first])
        self._masks[key] = entry
        if len(self._masks) > MASK_CACHE:
            self._masks.popitem(last=False)
        return entry

    def _arrays(self):
        p = self.pushdown
        return p.table, p.accepting, p.call_offsets, p.call_targets, p.call_returns, p.close_bytes


# -----------------------------------------------------------------------------------------------
# The Numba kernels. A configuration inside a walk is (state, base, pushed[:n]): the state, how much
# of the real stack is still below (base: real[:base]), and the return states pushed since.


@njit(cache=True)
def _same(st, base, ln, loc, k, s, b, n, pushed):
    if st[k] != s or base[k] != b or ln[k] != n:
        return False
    for i in range(n):
        if loc[k, i] != pushed[i]:
            return False
    return True


@njit(cache=True)
def _add(st, base, ln, loc, count, s, b, n, pushed):
    """Append the configuration unless present or the arrays are full; return the new count."""
    for k in range(count):
        if _same(st, base, ln, loc, k, s, b, n, pushed):
            return count
    if count >= st.shape[0]:
        return count
    st[count], base[count], ln[count] = s, b, n
    loc[count, :n] = pushed[:n]
    return count + 1


@njit(cache=True)
def _step(table, accepting, call_offsets, call_targets, call_returns, real, byte,
          st, base, ln, loc, n, ost, obase, oln, oloc, wst, wbase, wln, wloc, pushed):
    """Read `byte` from the n configurations (st, base, ln, loc) into (ost ...); the closure over
    calls and returns runs in the work arrays (w...). Returns (count, popped below the bottom)."""
    if n == 1 and call_offsets[st[0]] == call_offsets[st[0] + 1] and not accepting[st[0]]:
        t = table[st[0], byte]   # the common case (inside a string, a number): one plain byte move
        if t < 0:
            return 0, False
        ost[0], obase[0], oln[0] = t, base[0], ln[0]
        oloc[0, :ln[0]] = loc[0, :ln[0]]
        return 1, False
    w = 0
    for i in range(n):
        w = _add(wst, wbase, wln, wloc, w, st[i], base[i], ln[i], loc[i])
    m, popped, k = 0, False, 0
    while k < w:
        g, b, depth = wst[k], wbase[k], wln[k]
        t = table[g, byte]
        if t >= 0:
            m = _add(ost, obase, oln, oloc, m, t, b, depth, wloc[k])
        if depth < pushed.shape[0]:
            for c in range(call_offsets[g], call_offsets[g + 1]):
                pushed[:depth] = wloc[k, :depth]
                pushed[depth] = call_returns[c]
                w = _add(wst, wbase, wln, wloc, w, call_targets[c], b, depth + 1, pushed)
        if accepting[g]:
            if depth > 0:
                w = _add(wst, wbase, wln, wloc, w, wloc[k, depth - 1], b, depth - 1, wloc[k])
            elif b > 0:
                w = _add(wst, wbase, wln, wloc, w, real[b - 1], b - 1, 0, wloc[k])
            else:
                popped = True
        k += 1
    return m, popped


@njit(cache=True)
def _buffers(levels):
    st = np.zeros((levels, MAX_CONFIGS), dtype=np.int32)
    base = np.zeros((levels, MAX_CONFIGS), dtype=np.int32)
    ln = np.zeros((levels, MAX_CONFIGS), dtype=np.int32)
    loc = np.zeros((levels, MAX_CONFIGS, MAX_PUSHES), dtype=np.int32)
    return st, base, ln, loc


@njit(cache=True, nogil=True)   # nogil: the compile thread walks while the engine thread runs
def trie_walk(table, accepting, call_offsets, call_targets, call_returns, close, g, real, real_cost,
              parent, byte, depth, subtree_end, token_starts, token_ids, vocab_size, max_depth):
    """Walk the vocabulary trie from (g, stack `real`): the sorted ids allowed, the fewest bytes
    that close the text after each of them, and the sorted ids for which some path pops below the
    bottom of `real` (and none stays above it). With an empty `real` standing for an unknown
    stack, those are the tokens that depend on it (and the closing bytes leave the unknown stack's
    out); with the real stack they are the tokens that would read on past a complete text."""
    st, base, ln, loc = _buffers(max_depth + 1)
    wst, wbase, wln, wloc = _buffers(8)
    wst, wbase, wln, wloc = wst.reshape(-1), wbase.reshape(-1), wln.reshape(-1), wloc.reshape(-1, MAX_PUSHES)
    pushed = np.zeros(MAX_PUSHES, dtype=np.int32)
    count = np.zeros(max_depth + 1, dtype=np.int64)
    st[0, 0], base[0, 0] = g, len(real)
    count[0] = 1
    state = np.zeros(vocab_size, dtype=np.int8)    # 0 masked, 1 allowed, 2 depends on the stack
    cost = np.zeros(vocab_size, dtype=np.int64)
    node, num_nodes = 1, len(parent)
    while node < num_nodes:
        d = depth[node]
        m, popped = _step(table, accepting, call_offsets, call_targets, call_returns, real, byte[node],
                          st[d - 1], base[d - 1], ln[d - 1], loc[d - 1], count[d - 1],
                          st[d], base[d], ln[d], loc[d], wst, wbase, wln, wloc, pushed)
        count[d] = m
        if popped:   # every token through this node may go on in the caller
            for k in range(token_starts[node], token_starts[subtree_end[node]]):
                if state[token_ids[k]] == 0:
                    state[token_ids[k]] = 2
        if m == 0:
            node = subtree_end[node]
            continue
        if token_starts[node] < token_starts[node + 1]:
            c = _closing_cost(close, st[d], base[d], ln[d], loc[d], m, real_cost)
            for k in range(token_starts[node], token_starts[node + 1]):
                state[token_ids[k]] = 1
                cost[token_ids[k]] = c
        node += 1
    allowed = np.flatnonzero(state == 1)
    return allowed, cost[allowed], np.flatnonzero(state == 2)


@njit(cache=True)
def _closing_cost(close, st, base, ln, loc, n, real_cost):
    """The fewest closing bytes over n configurations: the state's, each pushed return state's,
    and the real stack's below (real_cost[b]: its first b return states)."""
    best = np.iinfo(np.int64).max
    for i in range(n):
        c = close[st[i]] + real_cost[base[i]]
        for j in range(ln[i]):
            c += close[loc[i, j]]
        best = min(best, c)
    return best


@njit(cache=True, nogil=True)
def check_tokens(table, accepting, call_offsets, call_targets, call_returns, close, g, real, real_cost,
                 candidates, token_offsets, token_bytes):
    """(K,) bool: each candidate token's bytes can be read from (g, real stack); (K,) the fewest
    bytes that close the text after it."""
    st, base, ln, loc = _buffers(2)
    wst, wbase, wln, wloc = _buffers(8)
    wst, wbase, wln, wloc = wst.reshape(-1), wbase.reshape(-1), wln.reshape(-1), wloc.reshape(-1, MAX_PUSHES)
    pushed = np.zeros(MAX_PUSHES, dtype=np.int32)
    out = np.zeros(len(candidates), dtype=np.bool_)
    cost = np.zeros(len(candidates), dtype=np.int64)
    for i in range(len(candidates)):
        t = candidates[i]
        st[0, 0], base[0, 0], ln[0, 0] = g, len(real), 0
        n, cur = 1, 0
        for k in range(token_offsets[t], token_offsets[t + 1]):
            n, _ = _step(table, accepting, call_offsets, call_targets, call_returns, real, token_bytes[k],
                         st[cur], base[cur], ln[cur], loc[cur], n,
                         st[1 - cur], base[1 - cur], ln[1 - cur], loc[1 - cur], wst, wbase, wln, wloc, pushed)
            cur = 1 - cur
            if n == 0:
                break
        out[i] = n > 0
        if n > 0:
            cost[i] = _closing_cost(close, st[cur], base[cur], ln[cur], loc[cur], n, real_cost)
    return out, cost
