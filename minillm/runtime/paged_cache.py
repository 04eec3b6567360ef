"""The paged KV cache: the K/V arrays that the block manager's block tables point into.

It implements the same two-method interface as the contiguous cache (``write`` then ``attend``,
once per layer; see minillm/model/kv_cache.py), so the one model forward runs on it unchanged.
Only the batch description grows: ``PagedAttentionMetadata`` adds each sequence's block table
(where its keys are) and each new token's slot (where its K/V go).

    storage per layer    K, V each (num_blocks, block_size, Hkv, Dh)
    write                scatter the batch's new K/V through slot_mapping (N,): the cache's
                         backend's write_kv, so a GPU backend can own its cache
    attend               paged attention over block_tables (B, max_blocks)

``DevicePagedKVCache`` is the same cache in GPU memory, for a model resident there
(minillm/model/device.py): allocated from the same budget, written by the device kernel from the
slot mapping; no K/V byte ever crosses the bus.

The cache never decides which block belongs to whom - that is the BlockManager's bookkeeping.
It only moves data: ``copy_block`` performs the copy-on-write the manager asks for.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from minillm.model.config import ModelConfig
from minillm.model.kv_cache import AttentionMetadata
from minillm.runtime.block_manager import slot_mapping

FLOAT32_BYTES = 4


def bytes_per_token(config: ModelConfig) -> int:
    """KV bytes one token occupies: K and V, in every layer, for every KV head, in float32."""
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * FLOAT32_BYTES


# -----------------------------------------------------------------------------
# the batch description

@dataclass
class PagedAttentionMetadata(AttentionMetadata):
    """AttentionMetadata plus where the keys live: ``block_tables`` (B, max_blocks) int32, padded
    past each sequence's blocks (padding is never read), and ``slot_mapping`` (N,) the slot of
    each new token. ``seq_slots`` is just the batch row here: storage is found through the tables.
    Build one with ``PagedAttentionMetadata.build``.
    """
    block_tables: np.ndarray = field(kw_only=True)
    slot_mapping: np.ndarray = field(kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        self.block_tables = np.asarray(self.block_tables, dtype=np.int32)  # (B, max_blocks)
        self.slot_mapping = np.asarray(self.slot_mapping, dtype=np.int64)  # (N,)
        if self.block_tables.ndim != 2 or len(self.block_tables) != self.num_seqs:
            raise ValueError(f"block_tables must be ({self.num_seqs}, max_blocks), got {self.block_tables.shape}")
        if self.slot_mapping.shape != (self.num_tokens,):
            raise ValueError(f"slot_mapping must hold one slot per new token ({self.num_tokens},), "
                             f"got {self.slot_mapping.shape}")

    @classmethod
    def build(cls, query_lens: Sequence[int], context_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
              block_size: int, *, logits_indices: np.ndarray | None = None) -> PagedAttentionMetadata:
        """From each sequence's own block table (as BlockManager.block_table gives it).

        Sequence b's new tokens sit at positions context_lens[b] .. context_lens[b] +
        query_lens[b] - 1; their slots come from its block table.
        """
        if not 0 < len(query_lens) == len(context_lens) == len(block_tables):
            raise ValueError(f"{len(query_lens)} query_lens, {len(context_lens)} context_lens and "
                             f"{len(block_tables)} block tables: one each per sequence, at least one sequence")
        slots = [slot_mapping(table, np.arange(start, start + n), block_size)  # (query_lens[b],)
                 for table, start, n in zip(block_tables, context_lens, query_lens)]
        return cls(query_lens, context_lens, np.arange(len(block_tables)), logits_indices=logits_indices,
                   block_tables=padded(block_tables), slot_mapping=np.concatenate(slots))


def padded(block_tables: Sequence[Sequence[int]]) -> np.ndarray:
    """The sequences' block tables as one (B, max_blocks) int32 array, zero past each table's end."""
    if len(block_tables) == 1:
        return np.array(block_tables, dtype=np.int32)  # (1, n_blocks)
    tables = np.zeros((len(block_tables), max(map(len, block_tables))), dtype=np.int32)  # (B, max_blocks)
    for b, table in enumerate(block_tables):
        tables[b, :len(table)] = table
    return tables


@dataclass
class DecodeMetadata(PagedAttentionMetadata):
    """PagedAttentionMetadata of a pure decode batch: sequence b brings one token, at position
    ``context_lens[b]``, and gets logits for it. Build one with ``DecodeMetadata.build``; it equals
    ``PagedAttentionMetadata.build([1] * B, context_lens, block_tables, block_size)``.

    The engine builds one every decode step, after the step's ~100 MB of weights have pushed the
    interpreter out of the CPU caches, so each NumPy call here costs several times what it costs in
    a loop. A decode batch's arrays follow from ``context_lens`` alone (one row per sequence:
    query_starts 0..B, positions = context_lens, logits at every row), so they are written down
    instead of derived, and only what can be wrong is checked: a negative context, a position its
    block table does not reach.
    """

    def __post_init__(self):
        n_seqs = len(self.context_lens)
        if n_seqs == 0:
            raise ValueError("AttentionMetadata describes no sequence")
        if self.context_lens.min() < 0:
            raise ValueError(f"context_lens must be >= 0, got {self.context_lens}")
        self.query_starts = np.arange(n_seqs + 1)  # (B+1,)
        self.positions = self.context_lens         # (B,) each new token sits right after its context

    @classmethod
    def build(cls, context_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
              block_size: int) -> DecodeMetadata:
        if not 0 < len(context_lens) == len(block_tables):
            raise ValueError(f"{len(context_lens)} context_lens and {len(block_tables)} block tables: "
                             f"one each per sequence, at least one sequence")
        # each new token's slot in plain Python, a few int operations a sequence: NumPy's vectorised
        # form (an array, a reach check, a gather, the slot arithmetic) cost more at every batch size,
        # its caches cold as in a step (2-core Xeon VM, medians of 200 builds, each after a 96 MB
        # sweep on both threads: 76 -> 52 us at one sequence, 92 -> 70 at 8, 121 -> 109 at 64)
        slots = []
        for context, table in zip(context_lens, block_tables):
            if context >= len(table) * block_size:
                raise ValueError(f"position {context} falls outside the {len(table)} blocks of {block_size} "
                                 f"tokens of its block table")
            slots.append(table[context // block_size] * block_size + context % block_size)
        rows = np.arange(len(slots))  # (B,) one row, and one logits row, per sequence
        return cls(np.ones(len(slots), dtype=np.int64), np.array(context_lens, dtype=np.int64), rows,
                   logits_indices=rows, block_tables=padded(block_tables), slot_mapping=np.array(slots, dtype=np.int64))


# -----------------------------------------------------------------------------
# the cache

class PagedKVCache:
    """Per layer K and V arrays of shape (num_blocks, block_size, Hkv, Dh), shared by all sequences,
    written by ``ops`` (the model's kernel backend: ``ops.write_kv``), in host memory (with the
    host-wrapper "cuda" backend its writes copy the cache to the device and back: the resident
    model uses ``DevicePagedKVCache``)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, ops):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a paged cache needs num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size, self.ops = num_blocks, block_size, ops
        shape = (config.n_layers, num_blocks, block_size, config.n_kv_heads, config.head_dim)
        self.k = np.zeros(shape, dtype=np.float32)  # (n_layers, num_blocks, block_size, Hkv, Dh)
        self.v = np.zeros(shape, dtype=np.float32)  # (n_layers, num_blocks, block_size, Hkv, Dh)

    def commit(self) -> None:
        """Write every page of the K/V arrays now. ``np.zeros`` only reserves address space: the
        pages become memory when first written, so without this the process grows block by block
        as requests (and the prefix cache) reach further into the pool, up to the whole budget."""
        self.k.fill(0)
        self.v.fill(0)

    def check(self, meta: AttentionMetadata) -> None:
        """The batch must say where its keys live (block tables, slot mapping); the kernels check those."""
        if not isinstance(meta, PagedAttentionMetadata):
            raise TypeError(f"the paged cache needs PagedAttentionMetadata (block tables, slot mapping), "
                            f"got {type(meta).__name__}")

    def write(self, layer: int, k: np.ndarray, v: np.ndarray, meta: PagedAttentionMetadata) -> None:
        """Store this batch's keys and values, k and v (N, Hkv, Dh), of ``layer`` at their slots."""
        self.ops.write_kv(self.k[layer], self.v[layer], k, v, meta.slot_mapping)

    def attend(self, layer: int, q: np.ndarray, meta: PagedAttentionMetadata, ops) -> np.ndarray:
        """Causal attention of q (N, H, Dh) over each sequence's blocks -> (N, H, Dh)."""
        k, v = self.k[layer], self.v[layer]  # (num_blocks, block_size, Hkv, Dh) each
        if (meta.query_lens == 1).all():     # a pure decode batch: one query per sequence, sees everything
            return ops.paged_attention_decode(q, k, v, meta.block_tables, meta.context_lens + 1)  # (B, H, Dh)
        return ops.paged_attention_prefill(q, k, v, meta.block_tables, meta.query_starts, meta.context_lens)  # (N, H, Dh)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: block dst gets block src's K/V, in every layer."""
        self.k[:, dst] = self.k[:, src]  # (n_layers, block_size, Hkv, Dh)
        self.v[:, dst] = self.v[:, src]  # (n_layers, block_size, Hkv, Dh)

    def paged_host_arrays(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(k, v) for a fused decode layer, which writes and attends as ``write`` and ``attend`` do
        here - so None in a subclass that changes what a batch does to the cache (the device cache)."""
        own = all(getattr(type(self), name) is getattr(PagedKVCache, name) for name in ("check", "write", "attend"))
        return (self.k, self.v) if own else None



class DevicePagedKVCache(PagedKVCache):
    """The paged cache in GPU memory, for a model on the device (``ops``: its resident backend).

    Per layer K and V are views of one (n_layers, num_blocks, block_size * Hkv * Dh) device array
    each, so ``copy_block`` is one copy kernel over every layer. Written by the resident
    ``write_kv`` (the slot mapping goes in, once per step; K/V never leave the device).
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, ops):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a paged cache needs num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        from minillm.kernels.cuda.tensor import DeviceTensor  # numba.cuda loads only for a device cache

        self.num_blocks, self.block_size, self.ops = num_blocks, block_size, ops
        flat = (config.n_layers, num_blocks, block_size * config.n_kv_heads * config.head_dim)
        self.k_blocks, self.v_blocks = DeviceTensor.empty(flat), DeviceTensor.empty(flat)
        shape = (config.n_layers, num_blocks, block_size, config.n_kv_heads, config.head_dim)
        self.k = self.k_blocks.array.reshape(*shape)  # (n_layers, num_blocks, block_size, Hkv, Dh) device
        self.v = self.v_blocks.array.reshape(*shape)

    def commit(self) -> None:
        """Nothing to do: device memory is resident once allocated. (It is not zeroed either: the
        kernels read only slots written before, so a fresh block's contents are never seen.)"""

    def check(self, meta: AttentionMetadata) -> None:
        """A forward begins: the backend forgets the last step's uploaded metadata."""
        super().check(meta)
        self.ops.begin_forward()

    def attend(self, layer: int, q, meta: PagedAttentionMetadata, ops):
        """Causal attention of q (N, H, Dh) over each sequence's blocks -> (N, H, Dh), on the device.

        One kernel for decode and prefill: a decode query is a prefill chunk of one token (its
        keys are its context plus itself), so every layer reuses the rows uploaded by the first."""
        return ops.paged_attention_prefill(q, self.k[layer], self.v[layer], meta.block_tables, meta.query_starts,
                                           meta.context_lens)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: block dst gets block src's K/V, in every layer, device to device."""
        from minillm.kernels.cuda.tensor import copy_into

        for store in (self.k_blocks.array, self.v_blocks.array):
            copy_into(store[:, src:src + 1], store[:, dst:dst + 1])
