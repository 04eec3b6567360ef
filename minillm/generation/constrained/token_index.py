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

Indexes are cached per (pattern, tokenizer): a schema is compiled once, however many requests use it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import njit

from minillm.generation.constrained.automata import DEAD, DFA, compile_byte_dfa
from minillm.generation.tokenizer import Tokenizer, complete_utf8_length


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


@lru_cache(maxsize=8)
def vocabulary_trie(tokenizer: Tokenizer) -> VocabularyTrie:
    """The trie of every token that stands for text (not special, not added, not empty)."""
    excluded = set(tokenizer.added_ids) | set(tokenizer.special_ids)
    token_ids = [t for t in range(tokenizer.vocab_size) if t not in excluded and tokenizer.id_to_bytes[t]]
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
    """Allowed tokens and next states for each state of a byte DFA, over one tokenizer's vocabulary."""

    def __init__(self, dfa: DFA, tokenizer: Tokenizer):
        self.dfa, self.tokenizer = dfa, tokenizer
        self.eos_id = tokenizer.eos_id
        self.byte_table = dfa.byte_table()                                    # (S, 256)
        self.offsets, self.token_ids, self.next_states = self._build()

    def _build(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The vocabulary's trie (built once per tokenizer), walked from every state by `walk_trie`."""
        trie = vocabulary_trie(self.tokenizer)
        return walk_trie(np.ascontiguousarray(self.byte_table, dtype=np.int32), self.dfa.accepting,
                         -1 if self.eos_id is None else self.eos_id, self.tokenizer.vocab_size,
                         trie.parent, trie.byte, trie.subtree_end, trie.token_starts, trie.token_ids)

    @property
    def num_states(self) -> int:
        return self.dfa.num_states

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


@njit(cache=True)
def walk_trie(table, accepting, eos_id, vocab_size, parent, byte, subtree_end, token_starts, token_ids):
    """Walk the trie from every state of `table` (S, 256), skipping the subtrees that die; return the
    CSR index: offsets (S+1,), then per state its sorted allowed ids and their next states."""
    num_states, num_nodes = table.shape[0], len(parent)
    offsets = np.zeros(num_states + 1, dtype=np.int64)
    ids = np.empty(1 << 16, dtype=np.int64)        # grown by doubling: the total is known only at the end
    nexts = np.empty(1 << 16, dtype=np.int32)
    walk = np.empty(num_nodes, dtype=np.int32)     # walk[node]: the state after the node's bytes
    lands = np.full(vocab_size, DEAD, dtype=np.int32)   # lands[t]: the state after token t; DEAD if masked
    for s in range(num_states):
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
        if start + n > len(ids):
            grown = max(2 * len(ids), start + n)
            ids, nexts = _grow(ids, grown), _grow(nexts, grown)
        # The walk found the tokens in trie order; read them off in id order. A pass over the
        # vocabulary is a few microseconds, less than sorting the allowed ids of a busy state.
        k = start
        for t in range(vocab_size):
            if lands[t] != DEAD:
                ids[k], nexts[k] = t, lands[t]
                lands[t] = DEAD                    # clean for the next state
                k += 1
        offsets[s + 1] = k
    return offsets, ids[:offsets[-1]].copy(), nexts[:offsets[-1]].copy()


@njit(cache=True)
def _grow(array, size):
    out = np.empty(size, dtype=array.dtype)
    out[:len(array)] = array
    return out


@lru_cache(maxsize=32)
def token_index(pattern: str, tokenizer: Tokenizer) -> TokenIndex:
    """The index of `pattern` over `tokenizer`'s vocabulary, built once per pair."""
    return TokenIndex(compile_byte_dfa(pattern), tokenizer)


def allowed_tokens(dfa: DFA, state: int, token_bytes: list[bytes], eos_id: int | None = None) -> np.ndarray:
    """The readable definition of one state's mask, token by token (TokenIndex computes the same for
    every state at once through the trie): the ids whose bytes walk from `state` without dying,
    plus `eos_id` if `state` is accepting. Empty tokens (special ones) are never allowed."""
    ids = [t for t, data in enumerate(token_bytes) if data and dfa.walk(data, state) != DEAD]
    if eos_id is not None and dfa.accepting[state]:
        ids = sorted({*ids, eos_id})
    return np.array(ids, dtype=np.int64)
