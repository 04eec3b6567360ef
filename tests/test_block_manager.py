"""The block manager: block tables, reference counts, prefix caching, copy-on-write.

Exercise tests (chapter 07 tasks 1-3) grade BlockPool, slot_mapping and hash_block through the
``impl`` fixture. The BlockManager tests below them check behaviour against hand-worked examples
and, in a random-workload state machine, against a shadow model: a simulated KV storage holding
one token id per slot, so every sequence's blocks can be read back and compared with the tokens
the sequence really has.
"""
import hashlib
import struct

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minillm.runtime.block_manager import BlockManager, BlockPool, hash_block, slot_mapping

# -----------------------------------------------------------------------------
# task 1: the block pool


@pytest.mark.ch07_block_table
def test_pool_hands_out_every_block_once_then_reports_exhaustion(impl):
    p = impl("ch07_paged_kv_cache")
    pool = p.BlockPool(5)
    taken = [pool.take() for _ in range(5)]
    assert sorted(taken) == [0, 1, 2, 3, 4] and pool.num_free == 0
    assert all(pool.blocks[b].ref_count == 1 for b in taken)
    with pytest.raises(RuntimeError):
        pool.take()
    pool.release(taken[2])
    assert pool.num_free == 1 and pool.take() == taken[2]


@pytest.mark.ch07_block_table
def test_pool_reference_counts_and_double_free(impl):
    p = impl("ch07_paged_kv_cache")
    pool = p.BlockPool(3)
    b = pool.take()
    pool.share(b)                      # a second block table holds it
    assert pool.blocks[b].ref_count == 2
    pool.release(b)
    assert pool.blocks[b].ref_count == 1 and pool.num_free == 2  # still held once: not free
    pool.release(b)
    assert pool.blocks[b].ref_count == 0 and pool.num_free == 3
    with pytest.raises(ValueError):
        pool.release(b)                # double free
    with pytest.raises(ValueError):
        pool.share(b)                  # free and holding nothing cached: cannot be shared
    with pytest.raises(ValueError):
        p.BlockPool(0)


@pytest.mark.ch07_block_table
def test_pool_cached_blocks_survive_free_and_are_evicted_least_recently_freed_first(impl):
    p = impl("ch07_paged_kv_cache")
    pool = p.BlockPool(4)
    a, b, c, d = (pool.take() for _ in range(4))
    for block, name in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.cache(block, name * 32, [ord(name)])
    for block in (b, d, a, c):         # free order: b first (least recent), c last
        pool.release(block)
    assert pool.num_free == 4          # cached free blocks still count as free capacity
    assert pool.lookup(b"a" * 32, [ord("a")]) == a
    assert pool.take() == d            # the empty block goes first; cached ones are kept
    assert pool.take() == b            # then the least recently freed cached block is evicted
    assert pool.lookup(b"b" * 32, [ord("b")]) is None and pool.blocks[b].hash is None
    pool.share(a)                      # a prefix hit revives a: it leaves the eviction queue
    assert pool.blocks[a].ref_count == 1 and pool.num_free == 1
    assert pool.take() == c
    with pytest.raises(RuntimeError):
        pool.take()


@pytest.mark.ch07_block_table
def test_pool_lookup_compares_token_ids_and_keeps_the_first_of_equal_blocks(impl):
    p = impl("ch07_paged_kv_cache")
    pool = p.BlockPool(2)
    first, second = pool.take(), pool.take()
    pool.cache(first, b"h" * 32, [1, 2, 3])
    assert pool.lookup(b"h" * 32, [1, 2, 3]) == first
    assert pool.lookup(b"h" * 32, [1, 2, 4]) is None   # same hash, other tokens: a collision, not a hit
    assert pool.lookup(b"x" * 32, [1, 2, 3]) is None
    pool.cache(second, b"h" * 32, [1, 2, 3])           # an equal block computed again elsewhere
    assert pool.lookup(b"h" * 32, [1, 2, 3]) == first
    pool.release(second)
    assert pool.take() == second                       # it stayed unnamed: an empty block again


# -----------------------------------------------------------------------------
# task 2: slot mapping


@pytest.mark.ch07_slot_mapping
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_slot_mapping_matches_block_and_offset(impl, block_size):
    p = impl("ch07_paged_kv_cache")
    rng = np.random.default_rng(block_size)
    table = rng.permutation(50)[:6]                            # shuffled, non-contiguous blocks
    positions = rng.integers(0, 6 * block_size, size=40)
    slots = p.slot_mapping(table, positions, block_size)
    expected = [table[t // block_size] * block_size + t % block_size for t in positions]  # the definition
    assert slots.shape == (40,) and np.issubdtype(slots.dtype, np.integer)
    np.testing.assert_array_equal(slots, expected)


@pytest.mark.ch07_slot_mapping
def test_slot_mapping_refuses_positions_outside_the_table(impl):
    p = impl("ch07_paged_kv_cache")
    with pytest.raises(ValueError):
        p.slot_mapping([3, 7], [0, 8], 4)  # the table holds positions 0..7
    with pytest.raises(ValueError):
        p.slot_mapping([3, 7], [-1], 4)


# -----------------------------------------------------------------------------
# task 3: the chained block hash


def sha256_oracle(token_ids, parent):
    """The documented definition, written independently: sha256(parent or 32 zero bytes, int64 LE ids)."""
    data = (parent if parent is not None else b"\0" * 32) + struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.sha256(data).digest()


@pytest.mark.ch07_block_hash
def test_block_hash_is_sha256_over_the_parent_and_the_token_ids(impl):
    p = impl("ch07_paged_kv_cache")
    first = p.hash_block([1, 2, 3, 70000], None)
    assert first == sha256_oracle([1, 2, 3, 70000], None) and len(first) == 32
    second = p.hash_block([5, 6, 7, 8], first)
    assert second == sha256_oracle([5, 6, 7, 8], first)
    assert p.hash_block(np.array([5, 6, 7, 8], dtype=np.int32), first) == second  # any int type


@pytest.mark.ch07_block_hash
def test_block_hash_names_the_whole_prefix(impl):
    p = impl("ch07_paged_kv_cache")
    paris, rome = p.hash_block([11, 12], None), p.hash_block([13, 12], None)
    assert p.hash_block([9, 9], paris) != p.hash_block([9, 9], rome)   # same tokens, other prefix
    assert p.hash_block([9, 9], paris) == p.hash_block([9, 9], paris)  # stable
    assert p.hash_block([1, 2], None) != p.hash_block([2, 1], None)    # order matters


# -----------------------------------------------------------------------------
# the block manager, by hand


def append_one(bm, seq):
    """A decode step's slot: one token after every held slot -> (its slot, the copy-on-write pairs)."""
    n = bm.num_slots(seq)
    copies = bm.allocate_slots(seq, n, 1)
    return (None if copies is None else slot_mapping(bm.block_table(seq), [n], bm.block_size)[0]), copies


def test_blocks_grow_one_at_a_time_and_slots_follow_the_table():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(100, 106))                      # 6 tokens: 2 blocks
    assert bm.allocate("a", tokens) == 0
    table = bm.block_table("a")
    assert len(table) == 2 and bm.num_used_blocks == 2 and bm.num_free_blocks == 6
    assert bm.usage == pytest.approx(2 / 8)
    for new in (106, 107):                              # positions 6, 7 fill the second block
        tokens.append(new)
        slot, copies = append_one(bm, "a")
        assert copies == [] and slot == table[1] * 4 + (len(tokens) - 1) % 4
        assert bm.block_table("a") == table
    tokens.append(108)                                  # position 8: the last block is full
    slot, copies = append_one(bm, "a")
    new_table = bm.block_table("a")
    assert copies == [] and len(new_table) == 3 and new_table[:2] == table and slot == new_table[2] * 4
    bm.free("a")
    assert bm.num_free_blocks == 8 and bm.usage == 0.0


def test_pool_size_from_a_memory_budget():
    bm = BlockManager.from_memory_budget(budget_bytes=10_000, bytes_per_token=100, block_size=16)
    assert bm.num_blocks == 6 and bm.block_size == 16   # 10_000 // (100 * 16)
    with pytest.raises(ValueError):
        BlockManager.from_memory_budget(budget_bytes=1_000, bytes_per_token=100, block_size=16)


def test_exhaustion_is_reported_not_raised_and_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.allocate("a", list(range(9)))                    # 3 blocks: the pool is full
    assert not bm.can_allocate("b", [1])
    with pytest.raises(RuntimeError):
        bm.allocate("b", [1])
    assert "b" not in bm.seqs and bm.num_free_blocks == 0
    assert bm.allocate_slots("a", 9, 3) == []           # positions 9..11 fit in the third block
    table = bm.block_table("a")
    assert bm.allocate_slots("a", 9, 4) is None         # position 12 needs a fourth block: refused ...
    assert bm.allocate_slots("a", 12, 1) is None
    assert bm.block_table("a") == table and bm.num_slots("a") == 12  # ... and nothing changed


def test_misuse_raises_clear_errors():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", [1, 2, 3])
    with pytest.raises(ValueError, match="already holds"):
        bm.allocate("a", [1])
    with pytest.raises(ValueError, match="empty prompt"):
        bm.allocate("b", [])
    with pytest.raises(ValueError, match="after its first 4"):
        bm.allocate_slots("a", 4, 1)                    # only 3 slots: token 4 cannot be computed yet
    with pytest.raises(ValueError, match="cannot write -1"):
        bm.allocate_slots("a", 3, -1)
    with pytest.raises(KeyError, match="'zz'"):
        bm.allocate_slots("zz", 0, 1)
    with pytest.raises(ValueError, match="already holds"):
        bm.fork("a", "a")
    bm.free("a")
    with pytest.raises(KeyError, match="already freed"):
        bm.free("a")


def test_fork_shares_every_block_and_copies_on_the_first_write_to_a_partial_one():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = [1, 2, 3, 4, 5, 6]                         # one full block, one partial
    bm.allocate("parent", prompt)
    bm.fork("parent", "child")
    shared = bm.block_table("parent")
    assert bm.block_table("child") == shared and bm.num_used_blocks == 2
    assert all(bm.pool.blocks[b].ref_count == 2 for b in shared)
    slot, copies = append_one(bm, "parent")
    parent_table = bm.block_table("parent")
    assert copies == [(shared[1], parent_table[1])] and parent_table[0] == shared[0]
    assert slot == parent_table[1] * 4 + 2
    slot, copies = append_one(bm, "child")              # the child now owns the old block alone
    assert copies == [] and slot == shared[1] * 4 + 2 and bm.block_table("child") == shared
    assert bm.pool.blocks[shared[0]].ref_count == 2     # the full block stays shared
    bm.free("parent")
    bm.free("child")
    assert bm.num_free_blocks == 8


def test_fork_at_a_block_boundary_needs_no_copy():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = [1, 2, 3, 4]
    bm.allocate("parent", prompt)
    bm.fork("parent", "child")
    for seq in ("parent", "child"):
        slot, copies = append_one(bm, seq)
        assert copies == [] and slot % 4 == 0
    assert bm.block_table("parent")[0] == bm.block_table("child")[0]
    assert bm.block_table("parent")[1] != bm.block_table("child")[1]


def test_prefix_cache_reuses_leading_full_blocks_and_always_computes_the_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    system = list(range(50, 58))                        # two full blocks shared by every prompt
    first = system + [1, 2, 3]
    assert bm.allocate("a", first) == 0
    bm.mark_computed("a", first, len(first))
    assert bm.allocate("b", system + [9, 9, 9, 9, 9]) == 8           # both system blocks reused
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    assert bm.allocate("c", system) == 4                # whole prompt cached: its last block is recomputed
    assert bm.allocate("d", system + [7]) == 8          # one more token: both blocks may be reused
    assert bm.allocate("e", [50, 51, 52, 99, 1, 2]) == 0  # differs inside the first block
    assert bm.prefix_cache_queries == 11 + 13 + 8 + 9 + 6
    assert bm.prefix_cache_hits == 8 + 4 + 8
    assert bm.pool.blocks[bm.block_table("a")[0]].ref_count == 4     # a, b, c, d


def test_blocks_are_shared_only_once_computed():
    """A prompt prefilled in chunks lends its blocks only after mark_computed says they are written."""
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(12))
    bm.allocate("a", prompt)
    assert bm.allocate("b", prompt) == 0                # nothing computed yet
    bm.mark_computed("a", prompt, 6)                    # first chunk: block 0 written, block 1 half
    assert bm.allocate("c", prompt) == 4
    bm.mark_computed("a", prompt, 12)
    assert bm.allocate("d", prompt) == 8


def test_slots_alone_never_make_a_block_reusable():
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = [1, 2, 3, 4, 5]
    bm.allocate("a", tokens[:3])
    bm.allocate_slots("a", 3, 2)                        # slots for positions 3, 4: block 0 is full of slots
    assert bm.allocate("b", tokens + [0]) == 0          # ... but not computed
    bm.mark_computed("a", tokens, 5)
    assert bm.allocate("c", tokens + [0]) == 4


def test_freed_prefix_blocks_stay_cached_until_evicted_least_recently_freed_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    prompts = {"a": [1, 1, 1, 1, 0], "b": [2, 2, 2, 2, 0]}  # one full block + one token each
    for seq in ("a", "b"):                              # a is freed first, so it is the older
        bm.allocate(seq, prompts[seq])
        bm.mark_computed(seq, prompts[seq], 5)
        bm.free(seq)
    assert bm.num_free_blocks == 4                      # cached blocks count as free
    bm.allocate("c", [3, 3, 3, 3, 3, 3, 3, 3, 3])       # 3 blocks: 2 empty, then evict a's block
    bm.free("c")
    assert bm.allocate("a2", prompts["a"]) == 0         # evicted
    assert bm.allocate("b2", prompts["b"]) == 4         # still cached


def test_free_releases_the_last_block_first_so_it_is_evicted_first():
    bm = BlockManager(num_blocks=3, block_size=2)
    prompt = [1, 2, 3, 4, 5]                            # blocks [1 2] [3 4] [5]
    bm.allocate("a", prompt)
    bm.mark_computed("a", prompt, 5)
    bm.free("a")
    bm.allocate("b", [9, 9, 9])                         # 2 blocks: the empty one, then evict [3 4]
    bm.free("b")
    assert bm.allocate("c", [1, 2, 3, 4, 7]) == 2       # [1 2] survived, [3 4] did not


@pytest.mark.ch10_kv_rollback
def test_release_tail_gives_back_exactly_the_blocks_past_the_new_end(impl):
    release_tail = impl("ch10_speculative").release_tail
    for block_size in (1, 3, 4):
        for num_tokens in range(1, 13):
            pool = BlockPool(6)
            table = [pool.take() for _ in range(min(6, -(-12 // block_size)))]
            held = len(table) * block_size
            if num_tokens > held:
                continue
            pool.share(table[-1])                            # the last block also sits in another table
            kept = release_tail(pool, table, num_tokens, block_size)
            keep = -(-num_tokens // block_size)              # brute force: ceil(num_tokens / block_size)
            assert kept == table[:keep]
            for i, block_id in enumerate(table):             # kept: still held; released: once each
                expected = (1 if i < keep else 0) + (i == len(table) - 1)
                assert pool.blocks[block_id].ref_count == expected


def test_lookahead_slots_then_truncate_free_whole_blocks_only():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", [1, 2, 3, 4, 5, 6])                # 2 blocks, 6 slots
    assert bm.allocate_slots("a", 6, 0, 6 * 4 + 3) is None  # more than the pool holds: refused
    assert bm.allocate_slots("a", 6, 1, 6) == []         # 13 slots: 4 blocks
    table = bm.block_table("a")
    assert len(table) == 4 and bm.num_slots("a") == 13 and bm.num_free_blocks == 4
    bm.truncate("a", 9)                                  # 3 blocks left; the 4th is free again
    assert bm.block_table("a") == table[:3] and bm.num_slots("a") == 9 and bm.num_free_blocks == 5
    bm.truncate("a", 9)                                  # truncating to the current length changes nothing
    assert bm.block_table("a") == table[:3]
    with pytest.raises(ValueError, match="cannot truncate to 10"):
        bm.truncate("a", 10)
    with pytest.raises(ValueError, match="cannot truncate to 0"):
        bm.truncate("a", 0)


def test_truncate_never_cuts_into_prefix_cached_blocks_nor_frees_shared_ones():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = [1, 2, 3, 4, 5, 6]
    bm.allocate("a", prompt)
    bm.mark_computed("a", prompt, 6)                     # block 0 ([1 2 3 4]) is now in the prefix cache
    with pytest.raises(ValueError, match="prefix-cached"):
        bm.truncate("a", 3)
    bm.fork("a", "b")                                    # b shares both blocks
    assert bm.allocate_slots("b", 6, 0, 3) == [(bm.block_table("a")[1], bm.block_table("b")[1])]  # tail copied
    bm.truncate("b", 4)                                  # b lets go of its private blocks ...
    shared = bm.block_table("a")[0]
    assert bm.block_table("b") == [shared] and bm.pool.blocks[shared].ref_count == 2  # ... never a's
    assert bm.num_free_blocks == 8 - 2


# -----------------------------------------------------------------------------
# random workloads against a shadow model


class RandomWorkload(RuleBasedStateMachine):
    """Allocate / prefill / decode / fork / free at random; the storage must always agree.

    ``storage`` simulates the KV cache: one token id per slot. Each sequence writes its tokens
    through the slots the manager gives it (performing the copies copy-on-write asks for), and
    after every step each live sequence must read back exactly its own tokens from its blocks.
    """

    @initialize(num_blocks=st.integers(4, 32), block_size=st.sampled_from([1, 2, 4]))
    def setup(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size)
        self.bs = block_size
        self.storage = np.full(num_blocks * block_size, -1)  # (num_slots,) the token each slot holds
        self.tokens = {}           # seq id -> its tokens (the logical content)
        self.registered = {}       # seq id -> tokens whose full blocks the manager was told are computed
        self.known_prefixes = set()  # every block-aligned token prefix ever reported computed
        self.cached_hashes = set()
        self.evicted = False       # once a cached block is evicted, hits can only be fewer
        self.next_id = 0
        self.queries = self.hits = 0

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    def _report_computed(self, seq, n):
        self.registered[seq] = max(self.registered[seq], n)
        toks = self.tokens[seq]
        for k in range(1, self.registered[seq] // self.bs + 1):
            self.known_prefixes.add(tuple(toks[:k * self.bs]))

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=12), mark=st.booleans())
    def allocate(self, prompt, mark):
        seq = self._new_id()
        if not self.bm.can_allocate(seq, prompt):
            return
        cached = self.bm.allocate(seq, prompt)
        # prefix hits: whole blocks, never the last token, and exactly the known prefix unless evicted
        expected = 0
        while expected + 1 <= (len(prompt) - 1) // self.bs and tuple(prompt[:(expected + 1) * self.bs]) in self.known_prefixes:
            expected += 1
        assert cached % self.bs == 0 and cached <= len(prompt) - 1
        assert cached <= expected * self.bs
        if not self.evicted:
            assert cached == expected * self.bs
        self.queries, self.hits = self.queries + len(prompt), self.hits + cached
        table = self.bm.block_table(seq)
        slots = slot_mapping(table, np.arange(len(prompt)), self.bs)             # (len,)
        np.testing.assert_array_equal(self.storage[slots[:cached]], prompt[:cached])  # reused blocks hold the prompt
        self.storage[slots[cached:]] = prompt[cached:]                           # prefill the rest
        self.tokens[seq], self.registered[seq] = list(prompt), 0
        if mark:                   # else the next write registers the prompt's blocks
            self.bm.mark_computed(seq, prompt, len(prompt))
            self._report_computed(seq, len(prompt))

    def _write(self, seq, tokens):
        """A step writes ``tokens`` after every held slot (all computed); False if the pool is short."""
        n = len(self.tokens[seq])
        copies = self.bm.allocate_slots(seq, n, len(tokens))
        if copies is None:
            assert self.bm.num_free_blocks < len(tokens) + 1
            return False
        for src, dst in copies:
            self.storage[dst * self.bs:(dst + 1) * self.bs] = self.storage[src * self.bs:(src + 1) * self.bs]
        self.storage[slot_mapping(self.bm.block_table(seq), np.arange(n, n + len(tokens)), self.bs)] = tokens
        return True

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data, token):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        if not self._write(seq, [token]):
            return
        toks = self.tokens[seq] = self.tokens[seq] + [token]
        self.bm.mark_computed(seq, toks, len(toks))
        self._report_computed(seq, len(toks))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 2), draft=st.lists(st.integers(0, 2), max_size=5))
    def speculate(self, data, token, draft):
        """A verify step: the newest token plus a draft get slots and are written; then a random
        number of draft tokens is accepted and the rest rolled back (as the engine does)."""
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        if not self._write(seq, [token, *draft]):   # the verify forward writes every row's K/V
            return
        toks = self.tokens[seq] + [token]
        table = self.bm.block_table(seq)
        accepted = data.draw(st.integers(0, len(draft)))
        toks += draft[:accepted]
        free_before = self.bm.num_free_blocks
        self.bm.truncate(seq, len(toks))
        released = len(table) - len(self.bm.block_table(seq))
        assert self.bm.num_free_blocks == free_before + released  # the draft's blocks are private: all come back
        self.bm.mark_computed(seq, toks, len(toks))
        self.tokens[seq] = toks
        self._report_computed(seq, len(toks))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self._new_id()
        self.bm.fork(parent, child)
        self.tokens[child], self.registered[child] = list(self.tokens[parent]), self.registered[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq)
        del self.tokens[seq], self.registered[seq]

    @invariant()
    def every_sequence_reads_back_its_own_tokens(self):
        for seq, toks in self.tokens.items():
            table = self.bm.block_table(seq)
            assert len(table) == -(-len(toks) // self.bs)
            slots = slot_mapping(table, np.arange(len(toks)), self.bs)
            np.testing.assert_array_equal(self.storage[slots], toks)

    @invariant()
    def reference_counts_equal_the_tables_holding_each_block(self):
        holders = {}
        for seq in self.tokens:
            table = self.bm.block_table(seq)
            assert len(set(table)) == len(table)
            for index, block in enumerate(table):
                holders.setdefault(block, []).append((seq, index))
        for block in self.bm.pool.blocks:
            assert block.ref_count == len(holders.get(block.block_id, []))
        for block_id, where in holders.items():  # a shared block sits at the same place in every table
            assert len({index for _, index in where}) == 1
        assert self.bm.num_free_blocks == sum(b.ref_count == 0 for b in self.bm.pool.blocks)
        assert self.bm.num_used_blocks == len(holders)

    @invariant()
    def counters_and_eviction(self):
        assert (self.bm.prefix_cache_queries, self.bm.prefix_cache_hits) == (self.queries, self.hits)
        now = set(self.bm.pool.cached)
        self.evicted |= bool(self.cached_hashes - now)
        self.cached_hashes = now

    def teardown(self):
        for seq in list(self.tokens):
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(b.ref_count == 0 for b in self.bm.pool.blocks)


RandomWorkload.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestRandomWorkload = RandomWorkload.TestCase
