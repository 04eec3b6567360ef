"""The KV cache as a pool of fixed-size blocks: block tables, reference counts, prefix caching.

A contiguous cache reserves ``max_len`` tokens per sequence up front. The paged cache instead cuts
KV memory into blocks of ``block_size`` tokens (16 by default) and gives each sequence a *block
table*: the list of physical blocks holding its tokens 0..15, 16..31, ... in order. Blocks are
handed out one at a time as a sequence grows, so memory in use is what the tokens need, rounded
up to one block per sequence.

    sequence "a" (37 tokens)   block table [4, 9, 2]     token 33 lives in block 2, offset 1
    sequence "b" (16 tokens)   block table [7]           slot = block * block_size + offset

Three ideas ride on the block tables, all bookkeeping - no K/V moves here (``PagedKVCache`` in
paged_cache.py holds the arrays, ``kernels/cpu/paged_attention.py`` reads them):

- **Reference counts.** A block may sit in several tables at once; it returns to the free pool
  when the last table lets go of it.
- **Prefix caching.** A *full* block, once its K/V are computed, is named by a hash chained over
  its parent block's hash and its own token ids, so equal hashes mean equal token prefixes. A
  new prompt walks its full blocks through the hash table and reuses every leading block already
  there (system prompts, chat history, few-shot examples). Freed blocks keep their hash and stay
  reusable until the pool needs the memory, least recently freed first.
- **Copy-on-write.** ``fork`` lets a child share all of its parent's blocks. The first write into
  a shared, partially filled block copies that block first, so no sequence ever sees another's
  tokens.

Running out of blocks is a normal condition: the scheduler asks ``can_allocate`` before admitting
a prompt, and ``allocate_slots`` answers None when the pool is short. Misuse - an unknown
sequence, a double free - raises. The scheduler (scheduler.py) is the only caller of the methods
that hand out or take back blocks.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np


# -----------------------------------------------------------------------------
# the chained block hash

NO_PARENT = bytes(32)  # the "parent hash" of a sequence's first block


def hash_block(token_ids: Sequence[int], parent_hash: bytes | None) -> bytes:
    """The name of a full block: sha256 over its parent's hash and its token ids -> 32 bytes.

    The digest covers ``parent_hash`` (``NO_PARENT``, 32 zero bytes, for a sequence's first
    block) followed by the token ids as little-endian int64. Chaining makes a block's hash stand
    for the whole prefix up to and including it. sha256 rather than Python's ``hash``: the
    value is the same in every process and on every machine, and collisions are out of reach
    (the pool still compares token ids on every hit).
    """
    digest = hashlib.sha256(NO_PARENT if parent_hash is None else parent_hash)
    digest.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return digest.digest()


# -----------------------------------------------------------------------------
# the physical blocks: free list, reference counts, cached prefix blocks

@dataclass(eq=False)
class Block:
    """One physical block of KV memory and what the manager knows about its contents."""
    block_id: int
    ref_count: int = 0                # block tables holding this block
    hash: bytes | None = None         # set once the block is full and computed
    token_ids: tuple[int, ...] = ()   # the tokens behind ``hash``, to rule out collisions


class BlockPool:
    """Every physical block: which are free, who holds the rest, which hold a cached prefix.

    Free blocks come in two kinds. *Empty* ones hold nothing worth keeping and are handed out
    first. *Evictable* ones still hold a cached full block (known hash): a later prompt may
    revive them, so they are recycled only when no empty block is left, least recently freed
    first. Both kinds count as free capacity.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.empty: deque[int] = deque(range(num_blocks))         # free, nothing to keep
        self.evictable: OrderedDict[int, None] = OrderedDict()   # free, cached; oldest first
        self.cached: dict[bytes, int] = {}                        # hash -> block id, used or free

    @property
    def num_free(self) -> int:
        return len(self.empty) + len(self.evictable)

    def take(self) -> int:
        """A block for new tokens, held once: an empty block, else the least recently freed cached one."""
        if self.empty:
            block_id = self.empty.popleft()
        elif self.evictable:
            block_id, _ = self.evictable.popitem(last=False)
            self._forget(self.blocks[block_id])  # its old contents are about to be overwritten
        else:
            raise RuntimeError("no free KV block left; ask can_allocate (or let allocate_slots answer None) first")
        self.blocks[block_id].ref_count = 1
        return block_id

    def share(self, block_id: int) -> None:
        """One more table holds a block already in use or cached; a free one leaves the eviction queue."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            if block_id not in self.evictable:
                raise ValueError(f"block {block_id} is free and holds nothing cached; take() a block instead")
            del self.evictable[block_id]
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        """One table lets go of a block; the last one returns it to the free pool."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            raise ValueError(f"block {block_id} is already free (double free)")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is None:
                self.empty.append(block_id)
            else:
                self.evictable[block_id] = None  # the most recently freed end: evicted last

    def cache(self, block_id: int, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Name a full, computed block by its hash so that later prompts can reuse it."""
        if block_hash in self.cached:  # an equal block is cached already: keep that one, this one stays private
            return
        block = self.blocks[block_id]
        block.hash, block.token_ids = block_hash, tuple(map(int, token_ids))
        self.cached[block_hash] = block_id

    def lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> int | None:
        """The cached block holding exactly these tokens after this prefix, or None."""
        block_id = self.cached.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != tuple(map(int, token_ids)):
            return None
        return block_id

    def _forget(self, block: Block) -> None:
        del self.cached[block.hash]
        block.hash, block.token_ids = None, ()


# -----------------------------------------------------------------------------
# slot mapping: a token's position -> its row in the flat KV storage

def slot_mapping(block_table: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray,
                 block_size: int) -> np.ndarray:
    """The storage slot of each position of one sequence: block * block_size + offset -> (N,) int64.

    Seen as (num_blocks * block_size, Hkv, Dh), the K (or V) storage of a layer has one row per
    slot, so a batch's new K/V are written with a single scatter through these indices.
    """
    block_table = np.asarray(block_table, dtype=np.int64)  # (n_blocks,)
    positions = np.asarray(positions, dtype=np.int64)      # (N,)
    if positions.size and (positions.min() < 0 or positions.max() >= len(block_table) * block_size):
        raise ValueError(f"positions {positions.min()}..{positions.max()} fall outside the "
                         f"{len(block_table)} blocks of {block_size} tokens of this block table")
    blocks = block_table[positions // block_size]          # (N,) the physical block of each position
    return blocks * block_size + positions % block_size    # (N,)


# -----------------------------------------------------------------------------
# rollback: the blocks past a sequence's new end go back to the pool

def release_tail(pool: BlockPool, block_table: Sequence[int], num_tokens: int, block_size: int) -> list[int]:
    """The block table of the first ``num_tokens`` tokens; every block past them is released once.

    Released last block first (as ``free`` does), so the least useful block is evicted first. A
    block another table shares only loses this holder: ``release`` counts references.
    """
    keep = -(-num_tokens // block_size)                       # blocks the kept tokens occupy
    for block_id in reversed(block_table[keep:]):
        pool.release(block_id)
    return list(block_table[:keep])


# -----------------------------------------------------------------------------
# the block manager: block tables of sequences on top of the pool

@dataclass
class SequenceBlocks:
    """What the manager keeps per sequence."""
    block_table: list[int]   # physical block of tokens [i * block_size, (i + 1) * block_size)
    num_tokens: int          # tokens given a slot so far (their K/V written, or about to be)
    hashes: list[bytes]      # chained hashes of the leading full blocks known to be computed


class BlockManager:
    """Gives sequences KV blocks, shares equal prefixes between them, and takes the blocks back.

    The step loop of a scheduler reads::

        if bm.can_allocate(seq, prompt):  cached = bm.allocate(seq, prompt)   # admit: prompt[cached:] to compute
        copies = bm.allocate_slots(seq, computed, n)   # slots for a step's n tokens (None: out of blocks)
        bm.mark_computed(seq, tokens, computed)        # after the step: full computed blocks become reusable
        bm.truncate(seq, computed)                     # give back the slots of rejected draft tokens
        bm.fork(seq, child);  bm.free(seq)
    """

    def __init__(self, num_blocks: int, block_size: int = 16):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.seqs: dict[Hashable, SequenceBlocks] = {}
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits = 0     # of those, tokens found there (their prefill skipped)

    @classmethod
    def from_memory_budget(cls, budget_bytes: int, bytes_per_token: int, block_size: int = 16) -> BlockManager:
        """As many blocks as ``budget_bytes`` of KV memory hold, at ``bytes_per_token`` (all layers, K and V)."""
        if bytes_per_token < 1:
            raise ValueError(f"bytes_per_token must be >= 1, got {bytes_per_token}")
        num_blocks = budget_bytes // (bytes_per_token * block_size)
        if num_blocks < 1:
            raise ValueError(f"{budget_bytes:,} bytes do not hold one block of {block_size} tokens "
                             f"at {bytes_per_token:,} bytes per token")
        return cls(num_blocks, block_size)

    # ---- usage figures -------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self.pool.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, counting those that still hold a reusable cached prefix."""
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences, 0.0 .. 1.0 (vLLM's kv_cache_usage_perc)."""
        return self.num_used_blocks / self.num_blocks

    def block_table(self, seq_id: Hashable) -> list[int]:
        """A copy of the sequence's block table."""
        return list(self._seq(seq_id).block_table)

    def num_slots(self, seq_id: Hashable) -> int:
        """Tokens of the sequence that have a slot (their K/V written, or about to be)."""
        return self._seq(seq_id).num_tokens

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` tokens occupy: a new block only when the last one is full."""
        return -(-num_tokens // self.block_size)

    # ---- prompts -----------------------------------------------------------

    def can_allocate(self, seq_id: Hashable, token_ids: Sequence[int]) -> bool:
        """Whether the free pool can hold this prompt now, reusing its cached prefix."""
        self._check_new(seq_id, token_ids)
        return self._free_blocks_needed(token_ids, self._cached_prefix(token_ids)) <= self.pool.num_free

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """Give a prompt its blocks; returns how many leading tokens are already cached.

        The count is a multiple of ``block_size`` and never covers the prompt's last token: that
        token is always computed, because its logits choose the first new token. (A whole block
        is recomputed rather than one token, so that no prefill ever writes into a shared block.)
        """
        self._check_new(seq_id, token_ids)
        hits = self._cached_prefix(token_ids)
        if self._free_blocks_needed(token_ids, hits) > self.pool.num_free:
            raise RuntimeError(f"not enough free KV blocks for sequence {seq_id!r} ({len(token_ids)} tokens, "
                               f"{self.num_free_blocks} blocks free); ask can_allocate first")
        for block_id in hits:  # revive cached blocks before taking fresh ones, which might evict them
            self.pool.share(block_id)
        fresh = [self.pool.take() for _ in range(self.num_blocks_for(len(token_ids)) - len(hits))]
        hashes = [self.pool.blocks[b].hash for b in hits]
        self.seqs[seq_id] = SequenceBlocks(hits + fresh, len(token_ids), hashes)
        cached = len(hits) * self.block_size
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += cached
        return cached

    def mark_computed(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int) -> None:
        """The K/V of the first ``num_computed`` tokens are in the cache: make their full blocks reusable.

        Call after every step that computed tokens of the sequence. Blocks become visible to other
        prompts only now, never at ``allocate``: a prompt prefilled in several chunks must not lend
        out blocks it has not written yet.
        """
        seq = self._seq(seq_id)
        if not 0 <= num_computed <= min(seq.num_tokens, len(token_ids)):
            raise ValueError(f"sequence {seq_id!r} has {seq.num_tokens} tokens with a slot and "
                             f"{len(token_ids)} token ids; {num_computed} cannot be computed")
        self._cache_full_blocks(seq, token_ids, num_computed)

    # ---- slots for the tokens of a step ---------------------------------------

    def allocate_slots(self, seq_id: Hashable, num_computed_tokens: int, num_new_tokens: int,
                       num_lookahead_tokens: int = 0) -> list[tuple[int, int]] | None:
        """Slots for the tokens a step writes: positions from ``num_computed_tokens`` on, ``num_new_tokens``
        of them (computed in the step) plus ``num_lookahead_tokens`` (written by a drafter) -> the
        copy-on-write ``(src, dst)`` pairs the cache must apply before the writes, or None when the free
        pool cannot hold them (then nothing changed: preempt someone, or do without).

        Slots the sequence holds already are kept; only the missing blocks are taken. A block the
        writes touch that another table shares (a fork's) is replaced by a private one first, and
        copied when it holds computed tokens. Nothing is hashed here: ``mark_computed`` does that
        once the K/V are in the cache.
        """
        seq, bs = self._seq(seq_id), self.block_size
        end = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        if not 0 <= num_computed_tokens <= seq.num_tokens or num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(f"sequence {seq_id!r} holds {seq.num_tokens} slots; cannot write {num_new_tokens} + "
                             f"{num_lookahead_tokens} tokens after its first {num_computed_tokens}")
        written = range(num_computed_tokens // bs, min(len(seq.block_table), self.num_blocks_for(end))
                        if end > num_computed_tokens else 0)     # held blocks the writes touch
        shared = [i for i in written if self.pool.blocks[seq.block_table[i]].ref_count > 1]
        fresh = max(0, self.num_blocks_for(end) - len(seq.block_table))
        if len(shared) + fresh > self.pool.num_free:
            return None
        copies = []
        for i in shared:                                # copy-on-write: the one place it happens
            src, dst = seq.block_table[i], self.pool.take()
            self.pool.release(src)
            seq.block_table[i] = dst
            if i * bs < num_computed_tokens:            # it holds computed K/V: they move along
                copies.append((src, dst))
        seq.block_table += [self.pool.take() for _ in range(fresh)]
        seq.num_tokens = max(seq.num_tokens, end)
        return copies

    # ---- speculative decoding: rollback ---------------------------------------

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Roll the sequence back to its first ``num_tokens`` slots: rejected draft tokens lose theirs.

        Blocks wholly past the new end go back to the pool (a block another table shares only
        loses this holder). A block registered in the prefix cache is never cut into: its K/V
        stand for a prompt prefix other sequences may reuse, so rolling back into it is refused.
        """
        seq = self._seq(seq_id)
        if not 0 < num_tokens <= seq.num_tokens:
            raise ValueError(f"sequence {seq_id!r} holds {seq.num_tokens} slots; cannot truncate to {num_tokens}")
        if num_tokens < len(seq.hashes) * self.block_size:
            raise ValueError(f"sequence {seq_id!r}: its first {len(seq.hashes) * self.block_size} tokens sit in "
                             f"prefix-cached blocks, which a rollback to {num_tokens} would overwrite")
        seq.block_table = release_tail(self.pool, seq.block_table, num_tokens, self.block_size)
        seq.num_tokens = num_tokens

    # ---- sharing and freeing -----------------------------------------------

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """The child shares every block of the parent; the first write into a shared partial block copies it."""
        parent = self._seq(parent_id)
        if child_id in self.seqs:
            raise ValueError(f"sequence {child_id!r} already holds KV blocks")
        for block_id in parent.block_table:
            self.pool.share(block_id)
        self.seqs[child_id] = SequenceBlocks(list(parent.block_table), parent.num_tokens, list(parent.hashes))

    def free(self, seq_id: Hashable) -> None:
        """Return the sequence's blocks; cached ones stay reusable until evicted."""
        seq = self._seq(seq_id)
        del self.seqs[seq_id]
        # Last block first, so it is evicted first: a cached block is useless once its prefix is gone.
        for block_id in reversed(seq.block_table):
            self.pool.release(block_id)

    # ---- internals ---------------------------------------------------------

    def _seq(self, seq_id: Hashable) -> SequenceBlocks:
        if seq_id not in self.seqs:
            raise KeyError(f"sequence {seq_id!r} holds no KV blocks (never allocated, or already freed)")
        return self.seqs[seq_id]

    def _check_new(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} already holds KV blocks; free it before allocating again")
        if len(token_ids) == 0:
            raise ValueError(f"sequence {seq_id!r} has an empty prompt")

    def _cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Block ids of the prompt's leading full blocks found in the prefix cache."""
        bs, hits, parent = self.block_size, [], None
        for i in range((len(token_ids) - 1) // bs):  # full blocks that leave the last token out
            chunk = token_ids[i * bs:(i + 1) * bs]
            parent = hash_block(chunk, parent)
            block_id = self.pool.lookup(parent, chunk)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _free_blocks_needed(self, token_ids: Sequence[int], hits: list[int]) -> int:
        """Free blocks a prompt consumes: the fresh ones, plus cached hits that are currently free."""
        revived = sum(self.pool.blocks[b].ref_count == 0 for b in hits)
        return revived + self.num_blocks_for(len(token_ids)) - len(hits)

    def _cache_full_blocks(self, seq: SequenceBlocks, token_ids: Sequence[int], num_computed: int) -> None:
        """Hash and register the full blocks among the first ``num_computed`` tokens not yet registered."""
        bs = self.block_size
        for i in range(len(seq.hashes), num_computed // bs):
            chunk = token_ids[i * bs:(i + 1) * bs]
            seq.hashes.append(hash_block(chunk, seq.hashes[-1] if seq.hashes else None))
            self.pool.cache(seq.block_table[i], seq.hashes[-1], chunk)
