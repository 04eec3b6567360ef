"""Paged attention equals contiguous attention, wherever the blocks are; the paged cache equals the
contiguous cache.

The oracle is the contiguous attention of the NumPy reference (``reference.attention`` and
``reference.attention_decode``) run on each sequence's keys laid out in order. The paged cache
under test is filled by direct indexing (block t // bs, offset t % bs, the definition) and every
slot no sequence owns holds NaN, so a kernel that reads past a sequence's end, or follows a
padding entry of a block table, returns NaN and fails.
"""
import numpy as np
import psutil
import pytest

from minillm.kernels import reference
from minillm.kernels.cpu.paged_attention import paged_attention_decode, paged_attention_prefill, write_kv
from minillm.kernels.registry import OPS, Backend, get_backend
from minillm.model.config import ModelConfig
from minillm.model.kv_cache import AttentionMetadata, ContiguousKVCache
from minillm.runtime.block_manager import BlockManager
from minillm.runtime.paged_cache import DecodeMetadata, PagedAttentionMetadata, PagedKVCache, bytes_per_token

N_HEADS, HEAD_DIM = 6, 8
DECODE = {"numba": paged_attention_decode, "reference": reference.paged_attention_decode}
PREFILL = {"numba": paged_attention_prefill, "reference": reference.paged_attention_prefill}
WRITE = {"numba": write_kv, "reference": reference.write_kv}


def paged_layout(rng, seq_lens, block_size, n_kv_heads, spare_blocks=3, head_dim=HEAD_DIM):
    """Random K/V per sequence, scattered into shuffled blocks of a NaN-filled cache.

    -> k_cache, v_cache (num_blocks, bs, Hkv, Dh); block_tables (B, max_blocks + 1) int32 whose
    padding names a block of NaNs; ks, vs: each sequence's keys/values in order (n, Hkv, Dh).
    """
    blocks_each = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_each) + spare_blocks
    shape = (num_blocks, block_size, n_kv_heads, head_dim)
    k_cache, v_cache = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    order = rng.permutation(num_blocks)                      # blocks handed out in shuffled order
    poison = order[-1]                                       # a spare block: stays NaN
    block_tables = np.full((len(seq_lens), max(blocks_each) + 1), poison, np.int32)
    ks, vs, used = [], [], 0
    for b, n in enumerate(seq_lens):
        blocks = order[used:used + blocks_each[b]]
        used += blocks_each[b]
        block_tables[b, :len(blocks)] = blocks
        k = rng.standard_normal((n, n_kv_heads, head_dim)).astype(np.float32)  # (n, Hkv, Dh)
        v = rng.standard_normal((n, n_kv_heads, head_dim)).astype(np.float32)  # (n, Hkv, Dh)
        for t in range(n):
            k_cache[blocks[t // block_size], t % block_size] = k[t]
            v_cache[blocks[t // block_size], t % block_size] = v[t]
        ks.append(k)
        vs.append(v)
    return k_cache, v_cache, block_tables, ks, vs


LAYOUTS = [  # (block_size, n_kv_heads, sequence lengths): on, before and one past block boundaries
    (1, 6, [1, 2, 7]),
    (4, 2, [1, 4, 5, 12, 13]),
    (16, 1, [16, 17, 3, 40]),
    (16, 2, [1, 700]),        # long enough to be split into chunks, next to one too short to split
    (8, 3, [1100]),
]


def check_decode(decode, block_size, n_kv_heads, seq_lens, seed=0, n_heads=N_HEADS, head_dim=HEAD_DIM):
    rng = np.random.default_rng(seed)
    k_cache, v_cache, tables, ks, vs = paged_layout(rng, seq_lens, block_size, n_kv_heads, head_dim=head_dim)
    q = rng.standard_normal((len(seq_lens), n_heads, head_dim)).astype(np.float32)  # (B, H, Dh)
    out = decode(q, k_cache, v_cache, tables, np.array(seq_lens))                   # (B, H, Dh)
    assert out.shape == q.shape and out.dtype == np.float32
    for b, n in enumerate(seq_lens):
        expected = reference.attention_decode(q[b], ks[b], vs[b], n)                # (H, Dh)
        np.testing.assert_allclose(out[b], expected, rtol=1e-4, atol=1e-5)


# -----------------------------------------------------------------------------
# task 4: paged decode attention


@pytest.mark.ch07_paged_attention
@pytest.mark.parametrize("block_size,n_kv_heads,seq_lens", LAYOUTS[:3])
def test_exercise_paged_decode_equals_contiguous_attention(impl, block_size, n_kv_heads, seq_lens):
    p = impl("ch07_paged_kv_cache")
    check_decode(p.paged_attention_decode, block_size, n_kv_heads, seq_lens)


@pytest.mark.ch07_paged_attention
def test_exercise_paged_decode_reads_only_the_sequences_blocks(impl):
    """The same keys in other blocks give the same answer; the scale argument is honoured."""
    p = impl("ch07_paged_kv_cache")
    rng = np.random.default_rng(1)
    k_cache, v_cache, tables, ks, vs = paged_layout(rng, [9], block_size=4, n_kv_heads=2)
    q = rng.standard_normal((1, N_HEADS, HEAD_DIM)).astype(np.float32)
    out = p.paged_attention_decode(q, k_cache, v_cache, tables, np.array([9]), scale=0.5)
    expected = reference.attention_decode(q[0], ks[0], vs[0], 9, scale=0.5)
    np.testing.assert_allclose(out[0], expected, rtol=1e-4, atol=1e-5)


# -----------------------------------------------------------------------------
# the package's kernels, both implementations


@pytest.mark.parametrize("impl_name", DECODE)
@pytest.mark.parametrize("block_size,n_kv_heads,seq_lens", LAYOUTS)
def test_paged_decode_equals_contiguous_attention(impl_name, block_size, n_kv_heads, seq_lens):
    check_decode(DECODE[impl_name], block_size, n_kv_heads, seq_lens)


@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim", [
    (9, 3, 64),   # SmolLM2-135M: a group of 3, four vectors of 16 floats a row
    (4, 1, 128),  # one kv head for four query heads, eight vectors a row
    (8, 2, 48),   # three vectors of 16
    (2, 2, 12),   # no group; vectors of 4 floats (12 is no multiple of 8)
])
def test_numba_decode_on_each_head_shape(n_heads, n_kv_heads, head_dim):
    """The decode kernel is unrolled over the group and the head's vectors (cpu/paged_attention.py):
    each shape is a kernel of its own, checked against the contiguous reference."""
    check_decode(paged_attention_decode, 16, n_kv_heads, [1, 16, 17, 300, 700], n_heads=n_heads, head_dim=head_dim)


PREFILL_CASES = [  # (block_size, n_kv_heads, [(cached context, new tokens), ...])
    (4, 2, [(0, 5), (7, 1), (8, 8), (3, 13)]),
    (1, 6, [(2, 3), (0, 1)]),
    (16, 1, [(16, 1), (15, 2), (0, 33), (40, 7)]),
    (16, 3, [(100, 70), (0, 130), (5, 1)]),  # several query and key tiles of the CPU prefill kernel
    (16, 3, [(150, 5), (40, 8), (0, 1)]),  # verify-sized spans: the CPU wrapper attends them by rows
    (16, 1, [(600, 2)]),                   # ... and splits the keys when the rows are too few jobs
]


@pytest.mark.parametrize("impl_name", PREFILL)
@pytest.mark.parametrize("block_size,n_kv_heads,chunks", PREFILL_CASES)
def test_paged_prefill_chunk_on_a_cached_prefix_equals_contiguous_attention(impl_name, block_size, n_kv_heads, chunks):
    rng = np.random.default_rng(2)
    context_lens = np.array([c for c, _ in chunks])
    query_lens = np.array([t for _, t in chunks])
    k_cache, v_cache, tables, ks, vs = paged_layout(rng, context_lens + query_lens, block_size, n_kv_heads)
    query_starts = np.concatenate([[0], np.cumsum(query_lens)])                     # (B+1,)
    q = rng.standard_normal((query_starts[-1], N_HEADS, HEAD_DIM)).astype(np.float32)  # (N, H, Dh)
    out = PREFILL[impl_name](q, k_cache, v_cache, tables, query_starts, context_lens)
    for b, start in enumerate(context_lens):
        rows = slice(query_starts[b], query_starts[b + 1])
        expected = reference.attention(q[rows], ks[b], vs[b], start)                # (T, H, Dh)
        np.testing.assert_allclose(out[rows], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim", [
    (9, 3, 64),   # SmolLM2-135M
    (4, 1, 128),  # two micro-tiles of four vectors across a row of values
    (8, 2, 48),   # three vectors of 16 floats
    (2, 2, 12),   # no group; vectors of 4 floats
])
def test_numba_prefill_on_each_head_shape(n_heads, n_kv_heads, head_dim):
    """The prefill kernel's tile products are unrolled over the head's vectors and pad the query
    rows to whole micro-tiles (cpu/paged_attention.py): each shape against the contiguous
    reference, with chunks that span several query and key tiles, on cached prefixes or none,
    and row counts that are no multiple of a micro-tile."""
    rng = np.random.default_rng(7)
    chunks = [(0, 70), (100, 33), (5, 1), (63, 2)]                                     # (cached, new)
    context_lens, query_lens = np.array([c for c, _ in chunks]), np.array([t for _, t in chunks])
    k_cache, v_cache, tables, ks, vs = paged_layout(rng, context_lens + query_lens, 16, n_kv_heads,
                                                    head_dim=head_dim)
    query_starts = np.concatenate([[0], np.cumsum(query_lens)])                       # (B+1,)
    q = rng.standard_normal((query_starts[-1], n_heads, head_dim)).astype(np.float32)  # (N, H, Dh)
    out = paged_attention_prefill(q, k_cache, v_cache, tables, query_starts, context_lens)
    for b, start in enumerate(context_lens):
        rows = slice(query_starts[b], query_starts[b + 1])
        np.testing.assert_allclose(out[rows], reference.attention(q[rows], ks[b], vs[b], start), rtol=1e-4, atol=1e-5)


def test_numba_kernels_equal_the_numpy_reference():
    rng = np.random.default_rng(3)
    k_cache, v_cache, tables, _, _ = paged_layout(rng, [30, 9, 64], block_size=8, n_kv_heads=3)
    q = rng.standard_normal((3, N_HEADS, HEAD_DIM)).astype(np.float32)
    lens = np.array([30, 9, 64])
    np.testing.assert_allclose(paged_attention_decode(q, k_cache, v_cache, tables, lens),
                               reference.paged_attention_decode(q, k_cache, v_cache, tables, lens), rtol=1e-4, atol=1e-5)
    starts, context = np.array([0, 10, 11, 75]), np.array([20, 8, 0])
    q = rng.standard_normal((75, N_HEADS, HEAD_DIM)).astype(np.float32)
    np.testing.assert_allclose(paged_attention_prefill(q, k_cache, v_cache, tables, starts, context),
                               reference.paged_attention_prefill(q, k_cache, v_cache, tables, starts, context),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("decode", DECODE.values(), ids=DECODE)
def test_bad_calls_are_refused_before_any_kernel_runs(decode):
    rng = np.random.default_rng(4)
    k_cache, v_cache, tables, _, _ = paged_layout(rng, [5, 9], block_size=4, n_kv_heads=2)
    q = rng.standard_normal((2, N_HEADS, HEAD_DIM)).astype(np.float32)
    bad = tables.copy()
    bad[1, 2] = len(k_cache)                                  # a block id past the cache
    with pytest.raises(ValueError, match="block tables name blocks"):
        decode(q, k_cache, v_cache, bad, np.array([5, 9]))
    with pytest.raises(ValueError, match="between 1 and"):
        decode(q, k_cache, v_cache, tables, np.array([5, 17]))  # more keys than the table holds
    with pytest.raises(ValueError, match="between 1 and"):
        decode(q, k_cache, v_cache, tables, np.array([0, 9]))
    with pytest.raises(ValueError, match="float32"):
        decode(q.astype(np.float64), k_cache, v_cache, tables, np.array([5, 9]))
    with pytest.raises(ValueError, match="multiple"):
        decode(q[:, :5], k_cache, v_cache, tables, np.array([5, 9]))


# -----------------------------------------------------------------------------
# writing through the slot mapping


@pytest.mark.parametrize("backend", WRITE)
def test_write_kv_scatters_each_row_to_its_slot(backend):
    write = WRITE[backend]
    rng = np.random.default_rng(5)
    num_blocks, block_size, n_kv_heads = 6, 4, 2
    k_cache = rng.standard_normal((num_blocks, block_size, n_kv_heads, HEAD_DIM)).astype(np.float32)
    v_cache = rng.standard_normal(k_cache.shape).astype(np.float32)
    k_before, v_before = k_cache.copy(), v_cache.copy()
    slots = rng.permutation(num_blocks * block_size)[:10]     # (N,) distinct, scattered
    k = rng.standard_normal((10, n_kv_heads, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((10, n_kv_heads, HEAD_DIM)).astype(np.float32)
    assert write(k_cache, v_cache, k, v, slots) is None       # in place
    for i, slot in enumerate(slots):                          # the definition: block slot // bs, offset slot % bs
        k_before[slot // block_size, slot % block_size] = k[i]
        v_before[slot // block_size, slot % block_size] = v[i]
    np.testing.assert_array_equal(k_cache, k_before)          # these rows, and nothing else, changed
    np.testing.assert_array_equal(v_cache, v_before)
    with pytest.raises(ValueError, match="slots must lie"):
        write(k_cache, v_cache, k[:1], v[:1], np.array([num_blocks * block_size]))
    with pytest.raises(ValueError, match="slots must lie"):
        write(k_cache, v_cache, k[:1], v[:1], np.array([-1]))
    with pytest.raises(ValueError, match=r"k and v \(2, 2, 8\)"):
        write(k_cache, v_cache, k[:1], v[:1], np.array([0, 1]))
    with pytest.raises(ValueError, match="integer slots"):
        write(k_cache, v_cache, k[:1], v[:1], np.array([0.0]))
    np.testing.assert_array_equal(k_cache, k_before)          # a refused write wrote nothing


def test_numba_write_kv_refuses_a_cache_it_would_write_a_copy_of():
    k_cache = np.zeros((4, 4, 2, HEAD_DIM), dtype=np.float32)
    k = np.ones((1, 2, HEAD_DIM), dtype=np.float32)
    with pytest.raises(ValueError, match="contiguous"):
        write_kv(k_cache[:, ::2], k_cache[:, ::2], k, k, np.array([0]))


def test_the_paged_cache_writes_through_its_backend():
    """K/V go through ops.write_kv (a GPU backend owns its cache), not through a kernel of its own."""
    numba = get_backend("numba")
    writes = []

    def recording_write_kv(*args):
        writes.append(args[4].copy())
        return reference.write_kv(*args)

    ops = Backend("recording", {**{op: getattr(numba, op) for op in OPS}, "write_kv": recording_write_kv})
    cache = PagedKVCache(CONFIG, num_blocks=4, block_size=4, ops=ops)
    meta = PagedAttentionMetadata.build([3], [2], [[3, 1]], block_size=4)
    rng = np.random.default_rng(9)
    k, v = (rng.standard_normal((3, 2, HEAD_DIM)).astype(np.float32) for _ in range(2))
    cache.write(1, k, v, meta)
    assert len(writes) == 1 and writes[0].tolist() == [14, 15, 4]  # positions 2, 3 in block 3; 4 in block 1
    np.testing.assert_array_equal(cache.k[1, 3, 2:], k[:2])
    np.testing.assert_array_equal(cache.v[1, 1, 0], v[2])
    assert not cache.k[0].any()                                  # another layer is untouched


# -----------------------------------------------------------------------------
# the paged cache against the contiguous cache

CONFIG = ModelConfig(architecture="llama", n_layers=2, hidden_size=48, intermediate_size=64, n_heads=N_HEADS,
                     n_kv_heads=2, head_dim=HEAD_DIM, rope_theta=10000.0, rope_style="half", rms_eps=1e-5,
                     vocab_size=100, tied_embeddings=True, qk_norm=False, context_length=128)


def test_bytes_per_token_is_what_the_cache_arrays_take():
    cache = PagedKVCache(CONFIG, num_blocks=5, block_size=4, ops=get_backend("numba"))
    assert cache.k.nbytes + cache.v.nbytes == bytes_per_token(CONFIG) * 5 * 4
    smollm2 = ModelConfig(architecture="llama", n_layers=30, hidden_size=576, intermediate_size=1536, n_heads=9,
                          n_kv_heads=3, head_dim=64, rope_theta=100000.0, rope_style="pairs", rms_eps=1e-5,
                          vocab_size=49152, tied_embeddings=True, qk_norm=False, context_length=8192)
    assert bytes_per_token(smollm2) == 2 * 30 * 3 * 64 * 4  # K and V, 30 layers, 3 kv heads of 64 floats


def test_commit_makes_the_whole_cache_resident_at_once():
    # np.zeros reserves address space; commit() must turn all of it into memory now (RSS, the kernel's count).
    # Arrays above glibc's largest mmap threshold (32 MiB), as a real KV cache is: smaller ones may reuse
    # heap pages an earlier test already touched.
    process = psutil.Process()
    cache = PagedKVCache(CONFIG, num_blocks=32768, block_size=16, ops=get_backend("numba"))  # K and V, 64 MiB each
    before = process.memory_info().rss
    cache.commit()
    grown = process.memory_info().rss - before
    assert grown > 0.9 * (cache.k.nbytes + cache.v.nbytes), grown
    assert not cache.k.any() and not cache.v.any()


def test_metadata_build_pads_the_tables_and_maps_each_new_token_to_its_slot():
    meta = PagedAttentionMetadata.build([2, 1], [2, 4], [[7, 2], [5, 1, 9]], block_size=2)
    np.testing.assert_array_equal(meta.block_tables, [[7, 2, 0], [5, 1, 9]])
    np.testing.assert_array_equal(meta.positions, [2, 3, 4])
    np.testing.assert_array_equal(meta.slot_mapping, [2 * 2 + 0, 2 * 2 + 1, 9 * 2 + 0])
    with pytest.raises(ValueError, match="one each per sequence"):
        PagedAttentionMetadata.build([2], [3, 4], [[7, 2], [5]], block_size=2)


@pytest.mark.parametrize("context_lens, tables", [([0], [[3]]), ([5, 0, 7], [[7, 2, 4], [5], [1, 9, 6, 8]])])
def test_decode_metadata_is_the_general_build_of_a_one_token_batch(context_lens, tables):
    decode = DecodeMetadata.build(context_lens, tables, block_size=2)
    general = PagedAttentionMetadata.build([1] * len(tables), context_lens, tables, block_size=2)
    for name in ("query_lens", "context_lens", "seq_slots", "logits_indices", "query_starts", "positions",
                 "block_tables", "slot_mapping"):
        np.testing.assert_array_equal(getattr(decode, name), getattr(general, name), err_msg=name)
        assert getattr(decode, name).dtype == getattr(general, name).dtype, name
    assert decode.num_tokens == general.num_tokens and decode.max_position == general.max_position


def test_decode_metadata_refuses_what_the_general_build_refuses():
    with pytest.raises(ValueError, match="position 4 falls outside the 2 blocks of 2 tokens"):
        DecodeMetadata.build([1, 4], [[3], [5, 6]], block_size=2)
    with pytest.raises(ValueError, match="context_lens must be >= 0"):
        DecodeMetadata.build([-1], [[3]], block_size=2)
    for context_lens, tables in (([1, 2], [[3]]), ([], [])):
        with pytest.raises(ValueError, match="one each per sequence, at least one sequence"):
            DecodeMetadata.build(context_lens, tables, block_size=2)


class TwoCaches:
    """A paged cache driven by a BlockManager, next to a contiguous cache fed the same K/V."""

    def __init__(self, rng):
        self.rng = rng
        self.bm = BlockManager(num_blocks=24, block_size=4)
        self.paged = PagedKVCache(CONFIG, self.bm.num_blocks, self.bm.block_size, get_backend("numba"))
        self.contiguous = ContiguousKVCache(CONFIG, n_slots=4, max_len=40)
        self.tokens, self.row = {}, {}      # seq -> its token ids; seq -> its contiguous cache slot

    def add(self, seq, prompt_len):
        self.row[seq] = len(self.row)
        self.tokens[seq] = list(self.rng.integers(0, 100, prompt_len))
        assert self.bm.allocate(seq, self.tokens[seq]) == 0

    def grow(self, seq):
        """One more token; copy-on-write done on the paged side -> the slot allocate_slots gave it."""
        self.tokens[seq].append(int(self.rng.integers(0, 100)))
        position = len(self.tokens[seq]) - 1
        for copy in self.bm.allocate_slots(seq, position, 1):
            self.paged.copy_block(*copy)
        table = self.bm.block_table(seq)
        return table[position // self.bm.block_size] * self.bm.block_size + position % self.bm.block_size

    def step(self, batch):
        """batch: [(seq, context_len, n_new)]; write random K/V to both caches, compare attend()."""
        seqs, context, new = zip(*batch)
        paged_meta = PagedAttentionMetadata.build(new, context, [self.bm.block_table(s) for s in seqs],
                                                  self.bm.block_size)
        contiguous_meta = AttentionMetadata(new, context, [self.row[s] for s in seqs])
        n = sum(new)
        for layer in range(CONFIG.n_layers):
            k, v = (self.rng.standard_normal((n, CONFIG.n_kv_heads, HEAD_DIM)).astype(np.float32) for _ in "kv")
            q = self.rng.standard_normal((n, N_HEADS, HEAD_DIM)).astype(np.float32)
            self.paged.write(layer, k, v, paged_meta)
            self.contiguous.write(layer, k, v, contiguous_meta)
            out = self.paged.attend(layer, q, paged_meta, get_backend("numba"))
            expected = self.contiguous.attend(layer, q, contiguous_meta, get_backend("reference"))
            np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
        return paged_meta


def test_paged_cache_attends_like_the_contiguous_cache_through_prefill_decode_chunks_and_fork():
    two = TwoCaches(np.random.default_rng(6))
    two.add("a", 7)
    two.add("b", 12)
    two.step([("a", 0, 7), ("b", 0, 12)])                     # prefill
    slots = [two.grow("a"), two.grow("b")]
    meta = two.step([("a", 7, 1), ("b", 12, 1)])              # decode
    np.testing.assert_array_equal(meta.slot_mapping, slots)   # build() agrees with allocate_slots
    two.add("c", 9)
    two.grow("a")
    two.step([("a", 8, 1), ("c", 0, 5)])                      # a decode next to a prefill chunk
    two.step([("c", 5, 4)])                                   # the rest of c's prompt on its cached start
    two.bm.fork("a", "d")                                     # d shares a's blocks, a partial one included
    two.row["d"], two.tokens["d"] = 3, list(two.tokens["a"])
    two.contiguous.k[:, 3], two.contiguous.v[:, 3] = two.contiguous.k[:, 0], two.contiguous.v[:, 0]
    two.grow("a")                                             # a copies the shared partial block ...
    two.grow("d")                                             # ... and d, its only holder now, writes in place
    two.grow("b")
    two.step([("a", 9, 1), ("d", 9, 1), ("b", 13, 1)])
    assert two.bm.block_table("a")[:2] == two.bm.block_table("d")[:2]
    assert two.bm.block_table("a")[2] != two.bm.block_table("d")[2]


def test_the_paged_cache_refuses_contiguous_metadata():
    cache = PagedKVCache(CONFIG, num_blocks=4, block_size=4, ops=get_backend("numba"))
    meta = AttentionMetadata([1], [0], [0])
    with pytest.raises(TypeError, match="PagedAttentionMetadata"):
        cache.check(meta)  # the forward asks once per batch, before any layer writes
