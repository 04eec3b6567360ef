"""The token index: for every state of a byte DFA, the vocabulary tokens that keep it alive.

A sampler masks logits by token, but the DFA reads bytes. Lifting one to the other means asking,
for each DFA state s and each token t: does walking t's bytes from s stay out of DEAD, and where
does it land? Asking it token by token costs (states x vocabulary x token length) steps. Tokens
share prefixes ("Ġthe", "Ġthere", "Ġtheir"), so we put the vocabulary in a byte trie and walk
the trie instead: each trie node is one byte step from its parent, so one gather per node,
done for all states at once, level by level (the outlines / xgrammar idea, vectorised):

    walk[s, root] = s
    walk[s, node] = table[walk[s, parent(node)], byte(node)]      for all states s at once
    next_state[s, t] = walk[s, node_of(t)]                         DEAD: t is masked out in s

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

from minillm.generation.constrained.automata import DEAD, DFA, compile_byte_dfa
from minillm.generation.tokenizer import Tokenizer, complete_utf8_length

STATE_CHUNK = 64  # DFA states walked together: bounds the (states x trie nodes) scratch array


@dataclass
class VocabularyTrie:
    """Every ordinary token's bytes in one trie; nodes are numbered so parents precede children."""
    parent: np.ndarray        # (N,) int64 parent node (the root is node 0, its own parent)
    byte: np.ndarray          # (N,) uint8 the byte on the edge from the parent
    level_starts: list[int]   # nodes of depth d are level_starts[d-1] .. level_starts[d]-1
    token_ids: np.ndarray     # (T,) the tokens in the trie
    token_nodes: np.ndarray   # (T,) the node each token ends at


@lru_cache(maxsize=8)
def vocabulary_trie(tokenizer: Tokenizer) -> VocabularyTrie:
    """The trie of every token that stands for text (not special, not added, not empty)."""
    excluded = set(tokenizer.added_ids) | set(tokenizer.special_ids)
    token_ids = [t for t in range(tokenizer.vocab_size) if t not in excluded and tokenizer.id_to_bytes[t]]
    # Each distinct prefix of a token is one node; ordering by (length, bytes) puts parents first.
    prefixes = sorted({tokenizer.id_to_bytes[t][:k] for t in token_ids
                       for k in range(1, len(tokenizer.id_to_bytes[t]) + 1)}, key=lambda b: (len(b), b))
    node_of = {b"": 0, **{p: i + 1 for i, p in enumerate(prefixes)}}
    parent = np.array([0] + [node_of[p[:-1]] for p in prefixes], dtype=np.int64)
    byte = np.array([0] + [p[-1] for p in prefixes], dtype=np.uint8)
    depth = np.array([0] + [len(p) for p in prefixes])
    level_starts = [int(i) for i in np.searchsorted(depth, np.arange(1, depth.max() + 2))]
    return VocabularyTrie(parent, byte, level_starts, np.array(token_ids, dtype=np.int64),
                          np.array([node_of[tokenizer.id_to_bytes[t]] for t in token_ids], dtype=np.int64))


class TokenIndex:
    """Allowed tokens and next states for each state of a byte DFA, over one tokenizer's vocabulary."""

    def __init__(self, dfa: DFA, tokenizer: Tokenizer):
        self.dfa, self.tokenizer = dfa, tokenizer
        self.eos_id = tokenizer.eos_id
        self.byte_table = dfa.byte_table()                                    # (S, 256)
        self.offsets, self.token_ids, self.next_states = self._build()

    def _build(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        trie, S = vocabulary_trie(self.tokenizer), self.dfa.num_states
        # DEAD becomes a sink row S that maps every byte to itself, so a gather never needs a branch.
        table = np.vstack([np.where(self.byte_table >= 0, self.byte_table, S), np.full((1, 256), S)])  # (S+1, 256)
        ids_per_state, next_per_state = [], []
        for first in range(0, S, STATE_CHUNK):
            states = np.arange(first, min(first + STATE_CHUNK, S))
            walk = np.empty((len(states), len(trie.parent)), dtype=np.int32)  # (chunk, nodes)
            walk[:, 0] = states
            for lo, hi in zip(trie.level_starts[:-1], trie.level_starts[1:]):  # one depth at a time
                walk[:, lo:hi] = table[walk[:, trie.parent[lo:hi]], trie.byte[lo:hi]]
            ends = walk[:, trie.token_nodes]                                  # (chunk, T) state after each token
            for row, s in enumerate(states):
                alive = np.flatnonzero(ends[row] != S)
                ids, nxt = trie.token_ids[alive], ends[row, alive]
                if self.dfa.accepting[s] and self.eos_id is not None:        # EOS only where the text may end
                    ids, nxt = np.append(ids, self.eos_id), np.append(nxt, s)
                    order = np.argsort(ids, kind="stable")
                    ids, nxt = ids[order], nxt[order]
                ids_per_state.append(ids)
                next_per_state.append(nxt)
        offsets = np.zeros(S + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(i) for i in ids_per_state])
        return offsets, np.concatenate(ids_per_state).astype(np.int64), np.concatenate(next_per_state).astype(np.int32)

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
