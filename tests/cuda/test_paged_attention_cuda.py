"""The CUDA paged attention against the NumPy paged reference, on tiny shuffled-block layouts.

The oracle is reference.paged_attention_decode / reference.paged_attention_prefill (gather each
sequence's blocks, then contiguous attention). Every cache slot no sequence owns holds NaN, and the
padding entries of the block tables name a NaN block, so a kernel that reads past a sequence's last
key, or follows a padding entry, returns NaN and fails. Under the simulator each (query, head) is a
block of Python threads and every key costs five warp shuffles, so the layouts hold a handful of
keys (17 for the one case that needs two warps to merge).
"""
import numpy as np
import pytest

import minillm.kernels.cuda as gpu
from minillm.kernels import reference

pytestmark = pytest.mark.cuda

RTOL = 1e-5
DOT_ATOL = 1e-4


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def paged_layout(rng, seq_lens, block_size, n_kv_heads, head_dim):
    """Random keys and values for sequences of seq_lens tokens, in shuffled blocks of a NaN cache.

    -> k_cache, v_cache (num_blocks, block_size, Hkv, Dh); block_tables (B, max_blocks + 1) int32,
    padded with a block that holds only NaN.
    """
    blocks_each = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_each) + 1                        # + the poison block
    shape = (num_blocks, block_size, n_kv_heads, head_dim)
    k_cache, v_cache = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    order = rng.permutation(num_blocks)                      # blocks handed out in shuffled order
    block_tables = np.full((len(seq_lens), max(blocks_each) + 1), order[-1], np.int32)  # (B, max_blocks + 1)
    used = 0
    for b, n in enumerate(seq_lens):
        blocks = order[used:used + blocks_each[b]]           # (blocks_each[b],) not contiguous, not sorted
        used += blocks_each[b]
        block_tables[b, :len(blocks)] = blocks
        for t in range(n):
            k_cache[blocks[t // block_size], t % block_size] = rng.standard_normal((n_kv_heads, head_dim))
            v_cache[blocks[t // block_size], t % block_size] = rng.standard_normal((n_kv_heads, head_dim))
    return k_cache, v_cache, block_tables


DECODE_CASES = [
    # block_size, H, Hkv, Dh, context lengths, scale
    (2, 4, 2, 8, [2, 3], None),  # GQA groups of 2; a length on a block boundary and one past it
    (1, 2, 2, 5, [1, 3], None),  # block size 1: every key in a block of its own; a single key; H == Hkv; odd Dh
    (4, 1, 1, 40, [17], 0.5),  # 17 keys over 5 blocks: two warps merge; Dh > one warp; a scale
]


@pytest.mark.parametrize("block_size, H, Hkv, Dh, context_lens, scale", DECODE_CASES)
def test_paged_decode(rng, block_size, H, Hkv, Dh, context_lens, scale):
    k_cache, v_cache, tables = paged_layout(rng, context_lens, block_size, Hkv, Dh)
    q = rng.standard_normal((len(context_lens), H, Dh)).astype(np.float32)  # (B, H, Dh)
    lens = np.array(context_lens)
    got = gpu.paged_attention_decode(q, k_cache, v_cache, tables, lens, scale)  # (B, H, Dh)
    assert got.shape == q.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, reference.paged_attention_decode(q, k_cache, v_cache, tables, lens, scale),
                               rtol=RTOL, atol=DOT_ATOL)


PREFILL_CASES = [
    # block_size, H, Hkv, Dh, keys cached before the chunk, chunk lengths
    (2, 2, 1, 8, [0, 2, 1], [2, 1, 2]),  # a first chunk (no prefix); chunks of 1 and 2 on cached keys; GQA
    (1, 2, 2, 8, [0, 2], [2, 1]),  # block size 1; H == Hkv
]


@pytest.mark.parametrize("block_size, H, Hkv, Dh, context_lens, chunk_lens", PREFILL_CASES)
def test_paged_prefill_chunks_on_cached_prefixes(rng, block_size, H, Hkv, Dh, context_lens, chunk_lens):
    context_lens, chunk_lens = np.array(context_lens), np.array(chunk_lens)
    k_cache, v_cache, tables = paged_layout(rng, context_lens + chunk_lens, block_size, Hkv, Dh)
    query_starts = np.concatenate([[0], np.cumsum(chunk_lens)])  # (B+1,)
    q = rng.standard_normal((query_starts[-1], H, Dh)).astype(np.float32)  # (N, H, Dh)
    got = gpu.paged_attention_prefill(q, k_cache, v_cache, tables, query_starts, context_lens)  # (N, H, Dh)
    want = reference.paged_attention_prefill(q, k_cache, v_cache, tables, query_starts, context_lens)  # (N, H, Dh)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=DOT_ATOL)


def test_bad_arguments_name_the_problem(rng):
    k_cache, v_cache, tables = paged_layout(rng, [3], block_size=2, n_kv_heads=1, head_dim=4)
    q = rng.standard_normal((1, 2, 4)).astype(np.float32)  # (B, H, Dh)
    lens = np.array([3])
    bad = tables.copy()
    bad[0, 1] = len(k_cache)  # one past the last block
    with pytest.raises(ValueError, match="block tables name blocks"):
        gpu.paged_attention_decode(q, k_cache, v_cache, bad, lens)
    with pytest.raises(ValueError, match="between 1 and"):
        gpu.paged_attention_decode(q, k_cache, v_cache, tables, np.array([7]))  # more keys than 3 blocks of 2
    with pytest.raises(ValueError, match="paged decode: 2 queries for 1 sequences"):
        gpu.paged_attention_decode(np.concatenate([q, q]), k_cache, v_cache, tables, lens)
    with pytest.raises(ValueError, match="query_starts"):
        gpu.paged_attention_prefill(q, k_cache, v_cache, tables, np.array([0, 2]), np.array([0]))
    wide = np.zeros((1, 1, 1, 257), np.float32)  # (num_blocks, block_size, Hkv, Dh)
    with pytest.raises(ValueError, match="head_dim <= 256"):
        gpu.paged_attention_decode(np.zeros((1, 1, 257), np.float32), wide, wide, np.zeros((1, 1), np.int32),
                                   np.array([1]))


def test_write_kv_scatters_each_row_to_its_slot_as_the_reference_does(rng):
    num_blocks, block_size, n_kv_heads, head_dim = 3, 2, 2, 4
    k_cache = rng.standard_normal((num_blocks, block_size, n_kv_heads, head_dim)).astype(np.float32)
    v_cache = rng.standard_normal(k_cache.shape).astype(np.float32)
    slots = np.array([5, 0, 3])                                # (N,) scattered over the blocks
    k, v = (rng.standard_normal((3, n_kv_heads, head_dim)).astype(np.float32) for _ in range(2))
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    reference.write_kv(expected_k, expected_v, k, v, slots)
    gpu.write_kv(k_cache, v_cache, k, v, slots)
    np.testing.assert_array_equal(k_cache, expected_k)        # these rows, and nothing else, changed
    np.testing.assert_array_equal(v_cache, expected_v)
    for slot, row in zip(slots, k):                             # and the reference is the definition
        np.testing.assert_array_equal(k_cache[slot // block_size, slot % block_size], row)
    with pytest.raises(ValueError, match="slots must lie"):
        gpu.write_kv(k_cache, v_cache, k[:1], v[:1], np.array([num_blocks * block_size]))
    with pytest.raises(ValueError, match="contiguous"):
        gpu.write_kv(k_cache[:, ::2], v_cache[:, ::2], k[:1], v[:1], np.array([0]))
    np.testing.assert_array_equal(k_cache, expected_k)        # a refused write wrote nothing


def test_the_cuda_backend_attends_and_writes_with_these_kernels():
    from minillm.kernels.registry import get_backend

    ops = get_backend("cuda")
    assert ops.paged_attention_decode is gpu.paged_attention_decode
    assert ops.paged_attention_prefill is gpu.paged_attention_prefill
    assert ops.write_kv is gpu.write_kv
