"""The KV cache interface the forward uses, its batch description, and the contiguous cache.

One model forward serves every chapter. It takes a *flat batch*: the new tokens of B sequences
packed back to back (N tokens in all) and an ``AttentionMetadata`` that says where each sequence's
tokens start in the flat batch, how much of it is already cached, and so each token's position.
The forward asks the cache once whether the batch fits (``check``); then each layer hands its K/V
to the cache and asks it for the attention output. The contiguous cache below (chapter 05/06) and
the paged cache (chapter 07) implement that one small interface.

    flat batch (N = 3 + 1 + 2 tokens of B = 3 sequences):
        token_ids      [a0 a1 a2 | b7 | c4 c5]
        query_lens     [3, 1, 2]           new tokens per sequence
        context_lens   [0, 7, 4]           tokens of each sequence already in the cache
        query_starts   [0, 3, 4, 6]        where each sequence's tokens start (derived)
        positions      [0 1 2 | 7 | 4 5]   context_len + 0, 1, ... (derived)
        logits_indices [2, 3, 5]           the rows that get logits (default: each last token)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from minillm.model.config import ModelConfig


# -----------------------------------------------------------------------------
# the batch description

@dataclass
class AttentionMetadata:
    """Where each sequence of a flat batch lives: in the batch, in the cache, in time.

    ``query_lens`` (B,) new tokens per sequence in this batch; ``context_lens`` (B,) tokens of the
    sequence already in the cache before this batch; ``seq_slots`` (B,) the cache storage each
    sequence uses; ``logits_indices`` (L,) the flat rows that get logits (default: the last new
    token of each sequence). Derived: ``query_starts`` (B+1,) - sequence b owns flat rows
    ``query_starts[b]:query_starts[b+1]`` - and ``positions`` (N,), each token's position in its
    sequence (context_len, context_len + 1, ...).
    """
    query_lens: np.ndarray
    context_lens: np.ndarray
    seq_slots: np.ndarray
    logits_indices: np.ndarray | None = field(default=None, kw_only=True)
    query_starts: np.ndarray = field(init=False)
    positions: np.ndarray = field(init=False)

    def __post_init__(self):
        self.query_lens = np.asarray(self.query_lens, dtype=np.int64)      # (B,)
        self.context_lens = np.asarray(self.context_lens, dtype=np.int64)  # (B,)
        self.seq_slots = np.asarray(self.seq_slots, dtype=np.int64)        # (B,)
        n_seqs = len(self.query_lens)
        for name in ("query_lens", "context_lens", "seq_slots"):
            array = getattr(self, name)
            if array.shape != (n_seqs,):
                raise ValueError(f"AttentionMetadata.{name} has shape {array.shape}, expected ({n_seqs},)")
        if n_seqs == 0:
            raise ValueError("AttentionMetadata describes no sequence")
        if self.query_lens.min() < 1:
            raise ValueError(f"every sequence needs at least one new token, query_lens = {self.query_lens}")
        if self.context_lens.min() < 0:
            raise ValueError(f"context_lens must be >= 0, got {self.context_lens}")
        if self.seq_slots.min() < 0:
            raise ValueError(f"seq_slots must be >= 0, got {self.seq_slots}")
        if n_seqs > 1 and len(np.unique(self.seq_slots)) != n_seqs:
            raise ValueError(f"two sequences of one batch share a cache slot: seq_slots = {self.seq_slots}")
        self.query_starts = np.zeros(n_seqs + 1, dtype=np.int64)           # (B+1,)
        np.cumsum(self.query_lens, out=self.query_starts[1:])
        first = np.repeat(self.context_lens - self.query_starts[:-1], self.query_lens)  # (N,)
        self.positions = first + np.arange(self.num_tokens)                             # (N,)
        if self.logits_indices is None:
            self.logits_indices = self.query_starts[1:] - 1                    # (B,) last token of each
        self.logits_indices = np.asarray(self.logits_indices, dtype=np.int64)  # (L,)
        if self.logits_indices.size and (self.logits_indices.min() < 0
                                         or self.logits_indices.max() >= self.num_tokens):
            raise ValueError(f"logits_indices {self.logits_indices} fall outside the batch of {self.num_tokens} tokens")

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.query_starts[-1])

    @property
    def max_position(self) -> int:
        """The largest position in the batch (the last new token of the sequence that reaches furthest)."""
        return int((self.context_lens + self.query_lens).max()) - 1


# -----------------------------------------------------------------------------
# the interface the forward uses, once per layer

class KVCache(Protocol):
    """Storage for the keys and values of every layer, read back by attention."""

    def check(self, meta: AttentionMetadata) -> None:
        """Refuse (ValueError) a batch this cache cannot hold; the forward asks once per batch."""

    def write(self, layer: int, k: np.ndarray, v: np.ndarray, meta: AttentionMetadata) -> None:
        """Store this batch's keys and values, k and v (N, Hkv, Dh), of ``layer``."""

    def attend(self, layer: int, q: np.ndarray, meta: AttentionMetadata, ops) -> np.ndarray:
        """Causal attention of q (N, H, Dh) over each sequence's cached keys -> (N, H, Dh)."""

    def paged_host_arrays(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The (n_layers, num_blocks, block_size, Hkv, Dh) host K and V arrays that a fused decode
        layer (kernels/cpu/fused_decode.py) writes and reads itself, in place of ``write`` and
        ``attend`` - or None: then the forward calls ``write`` and ``attend``."""


# -----------------------------------------------------------------------------
# the contiguous cache: one fixed-length row of storage per sequence slot

class ContiguousKVCache:
    """Per layer K and V arrays of shape (n_slots, max_len, Hkv, Dh); sequence b uses row seq_slots[b].

    Simple and fast to index, but every slot reserves ``max_len`` tokens whether it uses them or
    not - the waste the paged cache of chapter 07 removes.
    """

    def __init__(self, config: ModelConfig, n_slots: int, max_len: int):
        if n_slots < 1 or max_len < 1:
            raise ValueError(f"a cache needs n_slots >= 1 and max_len >= 1, got {n_slots} and {max_len}")
        self.n_slots, self.max_len = n_slots, max_len
        shape = (config.n_layers, n_slots, max_len, config.n_kv_heads, config.head_dim)
        self.k = np.zeros(shape, dtype=np.float32)  # (n_layers, n_slots, max_len, Hkv, Dh)
        self.v = np.zeros(shape, dtype=np.float32)  # (n_layers, n_slots, max_len, Hkv, Dh)

    def check(self, meta: AttentionMetadata) -> None:
        """Refuse a batch that names a missing slot or would run past ``max_len``."""
        for b in range(meta.num_seqs):
            slot, end = meta.seq_slots[b], meta.context_lens[b] + meta.query_lens[b]
            if not 0 <= slot < self.n_slots:
                raise ValueError(f"sequence {b} uses cache slot {slot}, but the cache has {self.n_slots} slots")
            if end > self.max_len:
                raise ValueError(f"sequence {b} would reach {end} tokens, past the cache's max_len {self.max_len}")

    def write(self, layer: int, k: np.ndarray, v: np.ndarray, meta: AttentionMetadata) -> None:
        for b in range(meta.num_seqs):
            rows = slice(meta.query_starts[b], meta.query_starts[b + 1])
            start, slot = meta.context_lens[b], meta.seq_slots[b]
            end = start + meta.query_lens[b]
            self.k[layer, slot, start:end] = k[rows]  # (T, Hkv, Dh)
            self.v[layer, slot, start:end] = v[rows]  # (T, Hkv, Dh)

    def attend(self, layer: int, q: np.ndarray, meta: AttentionMetadata, ops) -> np.ndarray:
        out = np.empty(q.shape, dtype=q.dtype)  # (N, H, Dh) q may be a strided view: out is contiguous
        for b in range(meta.num_seqs):
            first, last = meta.query_starts[b], meta.query_starts[b + 1]
            start, slot = meta.context_lens[b], meta.seq_slots[b]
            kv_len = start + (last - first)
            k = self.k[layer, slot, :kv_len]  # (S, Hkv, Dh) this sequence's keys, the new ones included
            v = self.v[layer, slot, :kv_len]  # (S, Hkv, Dh)
            if last - first == 1:  # decode: one query, a matrix-vector product per head
                out[first] = ops.attention_decode(q[first], k, v, kv_len)       # (H, Dh)
            else:                  # prefill, or a prefill chunk on top of a cached context
                out[first:last] = ops.attention(q[first:last], k, v, start)     # (T, H, Dh)
        return out

    def paged_host_arrays(self) -> None:
        return None  # not paged: the fused layer's kernels read block tables
