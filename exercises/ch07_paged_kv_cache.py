"""Chapter 07 exercises: the paged KV cache.

Four pieces of the paged cache, each with exactly the signature of the package's own version
(see REFERENCE; read it after you have tried). Grade your work with

    .venv/bin/python -m pytest tests/test_block_manager.py tests/test_paged_attention.py \
        -m "ch07_block_table or ch07_slot_mapping or ch07_block_hash or ch07_paged_attention" --impl=exercises

Task 1 (ch07_block_table)     BlockPool: the free list, reference counts, cached blocks, LRU eviction
Task 2 (ch07_slot_mapping)    slot_mapping: token positions -> rows of the flat KV storage
Task 3 (ch07_block_hash)      hash_block: the chained hash that names a full block
Task 4 (ch07_paged_attention) paged_attention_decode: attention that follows a block table
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from minillm.runtime.block_manager import Block  # noqa: F401  (BlockPool.blocks holds these)

REFERENCE = {
    "BlockPool": "minillm.runtime.block_manager.BlockPool",
    "slot_mapping": "minillm.runtime.block_manager.slot_mapping",
    "hash_block": "minillm.runtime.block_manager.hash_block",
    "paged_attention_decode": "minillm.kernels.cpu.paged_attention.paged_attention_decode",
}

# The functions each task (pytest marker) grades: course.check(marker) runs its tests.
TASKS = {
    "ch07_block_table": ["BlockPool"],
    "ch07_slot_mapping": ["slot_mapping"],
    "ch07_block_hash": ["hash_block"],
    "ch07_paged_attention": ["paged_attention_decode"],
}


# -----------------------------------------------------------------------------
# Task 1: the free list and the blocks that block tables point into

class BlockPool:
    """Every physical KV block: which are free, who holds the rest, which hold a cached prefix.

    A block table is a list of block ids; this pool hands those ids out and takes them back.

    State to keep (the tests read ``blocks`` and ``num_free``; the rest is yours):
      - ``self.blocks``: a list of ``Block(block_id)`` (imported above), one per block; each has
        ``ref_count`` (how many block tables hold it), ``hash`` and ``token_ids`` (set by
        ``cache``, cleared when the block is evicted).
      - two kinds of free block (ref_count 0): *empty* ones, holding nothing worth keeping, and
        *evictable* ones, which still hold a cached full block (a known hash). A later prompt may
        revive an evictable block, so ``take`` hands out empty blocks first (in the order they
        were freed, or 0, 1, 2, ... at the start) and evicts cached ones only when no empty block
        is left - the least recently freed first. ``collections.deque`` and
        ``collections.OrderedDict`` (``popitem(last=False)``) do the work.
      - a dict from hash to block id, for every cached block, in use or free.

    Methods:
      num_free (property)          empty + evictable blocks: both count as free capacity
      take() -> int                a block for new tokens, ref_count 1; evicting one forgets its
                                   hash (``lookup`` no longer finds it). No free block left:
                                   raise RuntimeError.
      share(block_id)              ref_count + 1; an evictable block leaves the eviction queue.
                                   Sharing a free block that holds nothing cached: ValueError.
      release(block_id)            ref_count - 1; at 0 the block becomes empty (no hash) or
                                   evictable (hash), at the most-recently-freed end. Releasing a
                                   free block (a double free): ValueError.
      cache(block_id, block_hash, token_ids)
                                   name a full block; if another block already holds this hash,
                                   keep that one and leave this block unnamed.
      lookup(block_hash, token_ids) -> int | None
                                   the block cached under this hash *whose token ids are equal*
                                   (comparing tokens rules out hash collisions), else None.

    Raise ValueError if num_blocks < 1.
    """

    def __init__(self, num_blocks: int):
        raise NotImplementedError("chapter 7, task 1")

    @property
    def num_free(self) -> int:
        raise NotImplementedError("chapter 7, task 1")

    def take(self) -> int:
        raise NotImplementedError("chapter 7, task 1")

    def share(self, block_id: int) -> None:
        raise NotImplementedError("chapter 7, task 1")

    def release(self, block_id: int) -> None:
        raise NotImplementedError("chapter 7, task 1")

    def cache(self, block_id: int, block_hash: bytes, token_ids: Sequence[int]) -> None:
        raise NotImplementedError("chapter 7, task 1")

    def lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> int | None:
        raise NotImplementedError("chapter 7, task 1")


# -----------------------------------------------------------------------------
# Task 2: slot mapping

def slot_mapping(block_table: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray,
                 block_size: int) -> np.ndarray:
    """The storage slot of each position of one sequence -> (N,) int64.

    Token ``p`` lives in block ``block_table[p // block_size]`` at offset ``p % block_size``; its
    slot is ``block * block_size + offset`` - its row when the K (or V) storage of a layer is seen
    as (num_blocks * block_size, Hkv, Dh). Vectorise it: no Python loop over positions (NumPy
    fancy indexing does the table lookup for all positions at once).

    Raise ValueError if a position is negative or past the end of the table's blocks.
    """
    raise NotImplementedError("chapter 7, task 2")


# -----------------------------------------------------------------------------
# Task 3: the chained block hash

def hash_block(token_ids: Sequence[int], parent_hash: bytes | None) -> bytes:
    """The name of a full block -> 32 bytes.

    sha256 (``hashlib.sha256``) over ``parent_hash`` - or 32 zero bytes for a sequence's first
    block, when ``parent_hash`` is None - followed by the token ids as little-endian int64
    (``np.asarray(token_ids, dtype="<i8").tobytes()``); return the digest.

    Because each hash covers its parent's, two blocks have equal hashes only if the *whole
    prefix* up to and including them is equal: a block of "the" after "Paris is" is not the block
    of "the" after "Rome is". And sha256, unlike Python's ``hash``, gives the same value in every
    process.
    """
    raise NotImplementedError("chapter 7, task 3")


# -----------------------------------------------------------------------------
# Task 4: paged decode attention

def paged_attention_decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                           context_lens: np.ndarray, scale: float | None = None) -> np.ndarray:
    """One new query per sequence attending that sequence's keys, wherever its blocks are.

    q (B, H, Dh) float32; k_cache, v_cache (num_blocks, block_size, Hkv, Dh); block_tables
    (B, max_blocks) int, row b listing sequence b's blocks in token order (entries past its last
    block are padding: never read them); context_lens (B,) the keys sequence b holds, the new
    token's own included. -> (B, H, Dh) float32.

    For each sequence b and query head h: key t (t < context_lens[b]) is
    ``k_cache[block_tables[b, t // block_size], t % block_size, h // (H // Hkv)]`` - grouped-query
    attention reads the shared KV head by index, never copies it - and the output is
    softmax(scale * q . k) weighted sum of the values, scale defaulting to 1 / sqrt(Dh).
    Subtract the maximum score before exp. Loop over each sequence's blocks and, inside, over
    the tokens of one block: they are contiguous in memory. (Numba's ``@njit`` makes it fast;
    NumPy per sequence is fine for the tests.)
    """
    raise NotImplementedError("chapter 7, task 4")
