"""The token index: for every state of a byte DFA, the vocabulary tokens that keep it alive.

A sampler masks logits by token, but the DFA reads bytes. Lifting one to the other means asking,
for each DFA state s and each token t: does walking t's bytes from s stay out of DEAD, and where
does it land? Asking it token by token costs (states x vocabulary x token length) steps. Tokens
share prefixes ("Ġthe", "Ġthere", "Ġtheir"), so we put the vocabulary in a byte trie and walk
the trie instead, once per state (the outlines / xgrammar idea): each trie node is one byte step
from its parent,

    walk[root] = s
    walk[node] = table[walk[parent(node)], byte(node)]
    next_state[s, t] = walk[node_of(t)]                  DEAD: t is masked out in s

and a node that reaches DEAD kills every token below it, so its whole subtree is skipped. The trie
is numbered in depth-first preorder (its prefixes sorted as byte strings), which puts a node's
subtree in the run of nodes right after it: skipping is one jump to ``subtree_end[node]``. A state
inside a free string visits most of the trie; a state that forces '{' visits the root's children
and the one subtree under '{'. The walk is a Numba loop, so a state costs the nodes it visits.

The result is stored per state as sorted token ids with their next states (CSR). Special and
added tokens (``<|im_start|>`` ...) never match text; EOS is allowed exactly in accepting states.
Byte-level BPE needs no special care here: a token that ends inside a multi-byte character simply
lands in a DFA state between that character's bytes, and the next token must finish it.

An index can be large: a state inside a free string allows most of the vocabulary (49k tokens x
8 bytes), and ``[ -~]{0,1000}`` has a thousand such states. So the walk fills buffers sized at the
compile budget's ``token_index_bytes`` and stops the moment the next state would not fit
(``ConstraintTooLarge``), a few states at a time with a look at the budget's clock in between.
The buffers are allocated at that size but only the pages the walk writes are ever touched: they
cost address space, not memory.

Indexes are cached per (pattern, tokenizer), so that a schema is compiled once however many
requests use it, in a cache bounded in bytes (``INDEX_CACHE_BYTES``, least recently used out).

The three constructions chapter 11 builds are looked up where they are called, so that the course
can put a learner's in their place: ``automata.thompson`` and ``automata.determinize`` (inside
``byte_dfa``), and ``allowed_tokens`` here, which the trie walk computes for every state at once;
set to another function, the index asks that function state by state instead. The cache key holds
the three, so an index built by one set of them is never handed to another.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import njit

from minillm.generation.constrained import automata
from minillm.generation.constrained.automata import DEAD, DFA, byte_dfa
from minillm.generation.constrained.budget import CompileBudget, ConstraintTooLarge
from minillm.generation.tokenizer import Tokenizer, complete_utf8_length

INDEX_CACHE_BYTES = 512 << 20   # the index cache's bound: four indexes at the default per-index bound
STATES_PER_WALK = 64            # states walked between two looks at the budget's clock (~10 ms)


@dataclass
class VocabularyTrie:
    """Every ordinary token's bytes in one trie, nodes in depth-first preorder: node i's subtree is
    the nodes i .. subtree_end[i]-1, and a parent precedes its children."""
    parent: np.ndarray        # (N,) int64 parent node (the root is node 0, its own parent)
    byte: np.ndarray          # (N,) uint8 the byte on the edge from the parent
    depth: np.ndarray         # (N,) int64 the node's distance from the root, in bytes
    subtree_end: np.ndarray   # (N,) int64 the first node after node i's subtree
    token_ids: np.ndarray     # (T,) the tokens in the trie, in node order
    token_starts: np.ndarray  # (N+1,) the tokens ending at node i: token_ids[token_starts[i]:token_starts[i+1]]


def text_token_ids(tokenizer: Tokenizer) -> list[int]:
    """The tokens that stand for text: not special, not added, not empty."""
    excluded = set(tokenizer.added_ids) | set(tokenizer.special_ids)
    return [t for t in range(tokenizer.vocab_size) if t not in excluded and tokenizer.id_to_bytes[t]]


@lru_cache(maxsize=8)
def vocabulary_trie(tokenizer: Tokenizer) -> VocabularyTrie:
    """The trie of every token that stands for text (not special, not added, not empty)."""
    token_ids = text_token_ids(tokenizer)
    # Each distinct prefix of a token is one node. Sorted as byte strings, a prefix comes right
    # before its extensions ("ab" < "abc" < "abd" < "ac"): depth-first preorder.
    token_bytes = [tokenizer.id_to_bytes[t] for t in token_ids]
    prefixes = sorted({data[:k] for data in token_bytes for k in range(1, len(data) + 1)})
    node_of = {b"": 0, **{p: i + 1 for i, p in enumerate(prefixes)}}
    parent = np.array([0] + [node_of[p[:-1]] for p in prefixes], dtype=np.int64)
    byte = np.array([0] + [p[-1] for p in prefixes], dtype=np.uint8)
    depth = np.array([0] + [len(p) for p in prefixes], dtype=np.int64)
    # subtree sizes, deepest nodes first: each level adds its sizes to its parents
    size = np.ones(len(parent), dtype=np.int64)
    for d in range(int(depth.max()), 0, -1):
        nodes = np.flatnonzero(depth == d)
        np.add.at(size, parent[nodes], size[nodes])
    token_nodes = np.array([node_of[data] for data in token_bytes], dtype=np.int64)
    order = np.argsort(token_nodes, kind="stable")                  # ids stay ascending within a node
    token_starts = np.searchsorted(token_nodes[order], np.arange(len(parent) + 1))
    return VocabularyTrie(parent, byte, depth, np.arange(len(parent)) + size,
                          np.array(token_ids, dtype=np.int64)[order], token_starts.astype(np.int64))


class TokenIndex:
    """Allowed tokens and next states for each state of a byte DFA, over one tokenizer's vocabulary,
    built within `budget` (its ``token_index_bytes`` and clock)."""

    def __init__(self, dfa: DFA, tokenizer: Tokenizer, budget: CompileBudget | None = None):
        self.dfa, self.tokenizer = dfa, tokenizer
        self.eos_id = tokenizer.eos_id
        self.byte_table = np.ascontiguousarray(dfa.byte_table(), dtype=np.int32)   # (S, 256)
        self.offsets, self.token_ids, self.next_states = self._build(CompileBudget() if budget is None else budget)
        self.longest_text = dfa.longest_match()   # bytes of the longest text the pattern accepts; None: unbounded

    def _build(self, budget: CompileBudget) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The vocabulary's trie (built once per tokenizer), walked from every state by `walk_trie`
        into buffers of the budget's size, STATES_PER_WALK states per call; a mask other than the
        package's ``allowed_tokens`` is asked state by state (``_build_by_states``)."""
        if allowed_tokens is not TRIE_WALK_COMPUTES:
            return self._build_by_states(budget)
        trie, num_states = vocabulary_trie(self.tokenizer), self.num_states
        limit = budget.limits["token_index_bytes"]
        fixed = self.byte_table.nbytes + self.dfa.table.nbytes + 8 * (num_states + 1)   # the tables and offsets
        room = max(int(limit - fixed), 0) // 8                                     # entries: int32 id + int32 state
        offsets = np.zeros(num_states + 1, dtype=np.int64)
        ids, nexts = np.empty(room, dtype=np.int32), np.empty(room, dtype=np.int32)
        walk = np.empty(len(trie.parent), dtype=np.int32)
        lands = np.full(self.tokenizer.vocab_size, DEAD, dtype=np.int32)
        eos = -1 if self.eos_id is None else self.eos_id
        state = 0
        while state < num_states:
            budget.check_time()
            last = min(state + STATES_PER_WALK, num_states)
            stopped = walk_trie(self.byte_table, self.dfa.accepting, eos, state, last, offsets, ids, nexts, walk,
                                lands, trie.parent, trie.byte, trie.subtree_end, trie.token_starts, trie.token_ids)
            if stopped < last:   # the state `stopped` did not fit
                raise ConstraintTooLarge("token_index_bytes", limit, where=f"the constraint's token index "
                                         f"({num_states} DFA states; {stopped} fit)")
            state = last
        n = int(offsets[-1])
        return offsets, ids[:n], nexts[:n]

    def _build_by_states(self, budget: CompileBudget) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The index from ``allowed_tokens`` asked for each state, over the text tokens' bytes (the
        others empty), each allowed token's next state found by walking its bytes (EOS stays), within
        the budget's ``token_index_bytes`` and clock. A state costs a walk of the whole vocabulary."""
        token_bytes = [b""] * self.tokenizer.vocab_size
        for t in text_token_ids(self.tokenizer):
            token_bytes[t] = self.tokenizer.id_to_bytes[t]
        limit = budget.limits["token_index_bytes"]
        offsets, ids, nexts = [0], [], []
        for state in range(self.num_states):
            budget.check_time()
            allowed = np.unique(np.asarray(allowed_tokens(self.dfa, state, token_bytes, self.eos_id), dtype=np.int64))
            if allowed.size and not 0 <= allowed[0] <= allowed[-1] < len(token_bytes):
                raise ValueError(f"allowed_tokens gave state {state} token ids outside the vocabulary of "
                                 f"{len(token_bytes)}: {allowed[(allowed < 0) | (allowed >= len(token_bytes))][:5]}")
            ids += allowed.tolist()    # sorted, each once: next_state looks a token up by bisection
            nexts += [state if t == self.eos_id else self.dfa.walk(token_bytes[t], state) for t in allowed.tolist()]
            if 8 * len(ids) > limit:
                raise ConstraintTooLarge("token_index_bytes", limit, where=f"the constraint's token index "
                                         f"({self.num_states} DFA states; {state} fit)")
            offsets.append(len(ids))
        return np.array(offsets, dtype=np.int64), np.array(ids, dtype=np.int32), np.array(nexts, dtype=np.int32)

    @property
    def num_states(self) -> int:
        return self.dfa.num_states

    @property
    def nbytes(self) -> int:
        """The memory the index holds (its DFA included): what the cache counts."""
        return sum(a.nbytes for a in (self.offsets, self.token_ids, self.next_states, self.byte_table,
                                      self.dfa.table, self.dfa.accepting, self.dfa.boundaries))

    def allowed(self, state: int) -> np.ndarray:
        """(K,) sorted ids of the tokens allowed in `state`."""
        return self.token_ids[self.offsets[state]:self.offsets[state + 1]]

    def next_state(self, state: int, token_id: int) -> int:
        """The state after `token_id`; DEAD if the token is not allowed there."""
        lo, hi = self.offsets[state], self.offsets[state + 1]
        k = lo + np.searchsorted(self.token_ids[lo:hi], token_id)
        return int(self.next_states[k]) if k < hi and self.token_ids[k] == token_id else DEAD

    def forced_bytes(self, state: int) -> bytes:
        """The bytes the DFA forces from `state` (one live byte each, until a choice or the end),
        cut back to whole UTF-8 characters so that they can be tokenized as text."""
        out = bytearray()
        while not self.dfa.accepting[state] and len(out) < 256:
            live = np.flatnonzero(self.byte_table[state] >= 0)
            if len(live) != 1:
                break
            out.append(int(live[0]))
            state = int(self.byte_table[state, live[0]])
        return bytes(out[:complete_utf8_length(bytes(out))])

    def is_complete(self, state: int) -> bool:
        """An accepting state with no way to go on: only EOS is left."""
        return bool(self.dfa.accepting[state]) and not (self.byte_table[state] >= 0).any()


@njit(cache=True, nogil=True)
def walk_trie(table, accepting, eos_id, first, last, offsets, ids, nexts, walk, lands, parent, byte, subtree_end,
              token_starts, token_ids):
    """Walk the trie from the states first..last-1 of `table` (S, 256), skipping the subtrees that die,
    into the CSR index: offsets (S+1,), then per state its sorted allowed ids and their next states
    (ids, nexts: buffers of a fixed size). Returns the state after the last one that fit: `last`, or
    the state whose entries would overflow the buffers. Scratch: walk (N,) the state after each trie
    node's bytes; lands (V,) the state after each token, DEAD (masked) between states. Without the
    GIL: the engine thread runs while an index is built."""
    num_nodes, vocab_size = len(parent), len(lands)
    for s in range(first, last):
        walk[0] = s
        n = 0
        node = 1
        while node < num_nodes:
            state = table[walk[parent[node]], byte[node]]
            if state == DEAD:
                node = subtree_end[node]           # no token below this node survives
                continue
            walk[node] = state
            for k in range(token_starts[node], token_starts[node + 1]):
                lands[token_ids[k]] = state
            n += token_starts[node + 1] - token_starts[node]
            node += 1
        if accepting[s] and eos_id >= 0:           # EOS only where the text may end; it stays in s
            lands[eos_id] = s
            n += 1
        start = offsets[s]
        if start + n > len(ids):                   # no room: clean `lands`, report where it stopped
            for t in range(vocab_size):
                lands[t] = DEAD
            return s
        # The walk found the tokens in trie order; read them off in id order. A pass over the
        # vocabulary is a few microseconds, less than sorting the allowed ids of a busy state.
        k = start
        for t in range(vocab_size):
            if lands[t] != DEAD:
                ids[k], nexts[k] = t, lands[t]
                lands[t] = DEAD                    # clean for the next state
                k += 1
        offsets[s + 1] = k
    return last


class TokenIndexCache:
    """``token_index(pattern, tokenizer, budget=None)``: the index of `pattern` over `tokenizer`'s
    vocabulary, compiled within `budget` (pattern -> byte DFA -> index) the first time and kept
    while the cache's indexes hold at most `max_bytes`, least recently used out.

    Callable from any thread (the server compiles in a worker, ``LLM`` on its own): the dictionary
    is locked, a build is not, so two threads asking for a new pattern at once may both build it.
    A refused constraint is not remembered: asking again costs its budget again."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.nbytes = max_bytes, 0
        self.entries: OrderedDict[tuple, TokenIndex] = OrderedDict()   # (pattern, tokenizer, builders())
        self.lock = threading.Lock()

    def __call__(self, pattern: str, tokenizer: Tokenizer, budget: CompileBudget | None = None) -> TokenIndex:
        key = (pattern, tokenizer, builders())
        with self.lock:
            if (index := self.entries.get(key)) is not None:
                self.entries.move_to_end(key)
                return index
        budget = CompileBudget() if budget is None else budget
        index = TokenIndex(byte_dfa(pattern, budget), tokenizer, budget)
        with self.lock:
            if key not in self.entries:
                self.entries[key] = index
                self.nbytes += index.nbytes
                while self.nbytes > self.max_bytes and len(self.entries) > 1:   # the newest always stays
                    _, evicted = self.entries.popitem(last=False)
                    self.nbytes -= evicted.nbytes
        return index

    def cache_clear(self) -> None:
        with self.lock:
            self.entries.clear()
            self.nbytes = 0


token_index = TokenIndexCache(INDEX_CACHE_BYTES)


def builders() -> tuple:
    """The functions an index is built with now: NFA, DFA and token mask (the course may set its own)."""
    return automata.thompson, automata.determinize, allowed_tokens


def allowed_tokens(dfa: DFA, state: int, token_bytes: list[bytes], eos_id: int | None = None) -> np.ndarray:
    """The readable definition of one state's mask, token by token (TokenIndex computes the same for
    every state at once through the trie): the ids whose bytes walk from `state` without dying,
    plus `eos_id` if `state` is accepting. Empty tokens (special ones) are never allowed."""
    ids = [t for t, data in enumerate(token_bytes) if data and dfa.walk(data, state) != DEAD]
    if eos_id is not None and dfa.accepting[state]:
        ids = sorted({*ids, eos_id})
    return np.array(ids, dtype=np.int64)


TRIE_WALK_COMPUTES = allowed_tokens   # what TokenIndex's trie walk computes for every state at once
