"""Argument checks shared by every kernel backend: a bad call fails at once, naming the problem.

A compiled kernel handed mismatched shapes does not fail politely: it reads past the end of an
array and returns garbage (or crashes). So every backend checks its arguments here, in Python,
before any compiled code runs. Each check returns nothing and raises ValueError on bad input.
"""
import numpy as np
from numba import njit

ROPE_STYLES = ("half", "pairs")


FLOAT32 = np.dtype(np.float32)


def check_float32(**arrays: np.ndarray) -> None:
    """The compiled kernels are fp32 only (one specialisation each, no silent float64 copies)."""
    for name, a in arrays.items():
        if a.dtype is not FLOAT32 and a.dtype != FLOAT32:  # identity first: `!=` converts, 5x slower
            raise ValueError(f"{name} must be float32, got {a.dtype}")


def check_matmul(a: np.ndarray, b: np.ndarray) -> None:
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"matmul needs a (M, K) and b (K, N), got shapes {a.shape} and {b.shape}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul inner sizes differ: a {a.shape} has K={a.shape[1]}, b {b.shape} has K={b.shape[0]}")


def check_linear(x: np.ndarray, w: np.ndarray) -> None:
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"linear needs x (T, in) and w (out, in), got shapes {x.shape} and {w.shape}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"linear: x {x.shape} has in={x.shape[1]} but w {w.shape} has in={w.shape[1]}")


def check_embedding(ids: np.ndarray, table: np.ndarray) -> None:
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"embedding ids must be a 1-D integer array, got {ids.dtype} of shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
        raise ValueError(f"embedding ids must lie in [0, {table.shape[0]}), got [{ids.min()}, {ids.max()}]")


def check_rms_norm(x: np.ndarray, weight: np.ndarray) -> None:
    if weight.ndim != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: x {x.shape} and weight {weight.shape} disagree on the last size")


def check_rope_shapes(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> None:
    """Everything check_rope checks but the positions' range (a kernel that checks it itself skips it)."""
    if style not in ROPE_STYLES:
        raise ValueError(f"rope style must be one of {ROPE_STYLES}, got {style!r}")
    if x.ndim != 3:
        raise ValueError(f"rope needs x (T, H, Dh), got shape {x.shape}")
    if positions.shape != (x.shape[0],):
        raise ValueError(f"rope needs one position per row of x {x.shape}, got positions {positions.shape}")
    if cos.shape != sin.shape or cos.ndim != 2 or 2 * cos.shape[1] != x.shape[2]:
        raise ValueError(f"rope tables {cos.shape}/{sin.shape} do not fit head_dim {x.shape[2]}")


def check_rope(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> None:
    check_rope_shapes(x, positions, cos, sin, style)
    if positions.size and (positions.min() < 0 or positions.max() >= cos.shape[0]):
        raise_rope_positions(positions, cos.shape[0])


def raise_rope_positions(positions: np.ndarray, n_positions: int) -> None:
    raise ValueError(f"rope positions must lie in [0, {n_positions}), got [{positions.min()}, {positions.max()}]")


def check_swiglu(gate: np.ndarray, up: np.ndarray) -> None:
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {gate.shape} and up {up.shape} differ")


def _check_kv(q_heads: int, head_dim: int, k: np.ndarray, v: np.ndarray) -> None:
    if k.ndim != 3 or k.shape != v.shape:
        raise ValueError(f"attention needs k and v of one shape (S, Hkv, Dh), got {k.shape} and {v.shape}")
    if k.shape[2] != head_dim:
        raise ValueError(f"attention: queries have head_dim {head_dim}, keys {k.shape[2]}")
    if k.shape[1] == 0 or q_heads % k.shape[1]:
        raise ValueError(f"attention: {q_heads} query heads are not a multiple of {k.shape[1]} kv heads")


def check_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> None:
    if q.ndim != 3:
        raise ValueError(f"attention needs q (T, H, Dh), got shape {q.shape}")
    _check_kv(q.shape[1], q.shape[2], k, v)
    if start < 0 or k.shape[0] < start + q.shape[0]:
        raise ValueError(f"attention: start {start} + {q.shape[0]} queries needs that many keys, k has {k.shape[0]}")


def check_attention_decode(q: np.ndarray, k: np.ndarray, v: np.ndarray, kv_len: int) -> None:
    if q.ndim != 2:
        raise ValueError(f"attention_decode needs q (H, Dh), got shape {q.shape}")
    _check_kv(q.shape[0], q.shape[1], k, v)
    if not 0 < kv_len <= k.shape[0]:
        raise ValueError(f"attention_decode: kv_len {kv_len} must lie in [1, {k.shape[0]}] (the keys held)")


# -----------------------------------------------------------------------------
# paged attention: a bad block table must fail here, not read random memory in a kernel


def check_paged_cache(k_cache: np.ndarray, v_cache: np.ndarray) -> None:
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"paged K/V caches must share one shape (num_blocks, block_size, Hkv, Dh), "
                         f"got {k_cache.shape} and {v_cache.shape}")
    if k_cache.dtype != np.float32 or v_cache.dtype != np.float32:
        raise ValueError(f"paged K/V caches must be float32, got {k_cache.dtype} and {v_cache.dtype}")


def check_write_kv(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray,
                   slot_mapping: np.ndarray) -> None:
    """k, v (N, Hkv, Dh), one row per slot of slot_mapping (N,), each slot inside the cache."""
    check_paged_cache(k_cache, v_cache)
    num_blocks, block_size, n_kv_heads, head_dim = k_cache.shape
    if slot_mapping.ndim != 1 or (slot_mapping.size and slot_mapping.dtype.kind not in "iu"):
        raise ValueError(f"write_kv needs integer slots (N,), got {slot_mapping.dtype} {slot_mapping.shape}")
    if k.shape != v.shape or k.shape != (len(slot_mapping), n_kv_heads, head_dim):
        raise ValueError(f"write_kv needs k and v ({len(slot_mapping)}, {n_kv_heads}, {head_dim}), one row "
                         f"per slot, got {k.shape} and {v.shape}")
    if slot_mapping.size and (slot_mapping.min() < 0 or slot_mapping.max() >= num_blocks * block_size):
        raise ValueError(f"slots must lie in [0, {num_blocks * block_size}), "
                         f"got {slot_mapping.min()}..{slot_mapping.max()}")


def check_contiguous_cache(k_cache: np.ndarray, v_cache: np.ndarray) -> None:
    """For a kernel that writes a flat copy of the cache back, or a reshaped view of it."""
    if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        raise ValueError("write_kv needs C-contiguous caches (a reshaped copy would swallow the write)")


def check_paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                     seq_lens: np.ndarray) -> None:
    """q (., H, Dh); block_tables (B, max_blocks); seq_lens (B,) keys each sequence holds."""
    check_paged_cache(k_cache, v_cache)
    num_blocks, block_size, n_kv_heads, head_dim = k_cache.shape
    if q.ndim != 3 or q.dtype != np.float32:
        raise ValueError(f"paged attention needs float32 q (N, H, Dh), got {q.dtype} {q.shape}")
    if q.shape[2] != head_dim:
        raise ValueError(f"paged attention: queries have head_dim {q.shape[2]}, the cache {head_dim}")
    if q.shape[1] % n_kv_heads:
        raise ValueError(f"paged attention: {q.shape[1]} query heads are not a multiple of {n_kv_heads} kv heads")
    if block_tables.ndim != 2 or block_tables.shape[0] != len(seq_lens):
        raise ValueError(f"block_tables must be (B, max_blocks) for B = {len(seq_lens)} sequences, "
                         f"got shape {block_tables.shape}")
    problem = _table_problem(block_tables, seq_lens, block_size, num_blocks)
    if problem == BAD_LENGTH:
        raise ValueError(f"every sequence must hold between 1 and {block_tables.shape[1]} blocks x "
                         f"{block_size} tokens of keys, got lengths {seq_lens}")
    if problem == BAD_BLOCK:
        used = np.arange(block_tables.shape[1]) < -(-seq_lens[:, None] // block_size)  # (B, max_blocks)
        blocks = block_tables[used]                                                   # the entries read
        raise ValueError(f"block tables name blocks {blocks.min()}..{blocks.max()}, "
                         f"but the cache has {num_blocks} blocks")


TABLE_OK, BAD_LENGTH, BAD_BLOCK = 0, 1, 2


@njit(cache=True)
def _table_problem(block_tables, seq_lens, block_size, num_blocks):
    """TABLE_OK if each sequence holds 1..max_blocks*block_size keys and every block it reads exists.

    Compiled because it runs once per layer of every step: the same test in NumPy took ~10 us, a
    few percent of a SmolLM2 decode step over 30 layers."""
    for b in range(len(seq_lens)):
        if seq_lens[b] < 1 or seq_lens[b] > block_tables.shape[1] * block_size:
            return BAD_LENGTH
        for i in range((seq_lens[b] + block_size - 1) // block_size):
            if block_tables[b, i] < 0 or block_tables[b, i] >= num_blocks:
                return BAD_BLOCK
    return TABLE_OK


@njit(cache=True)
def decode_values_fit(slot_mapping, n_slots, positions, n_positions, block_tables, seq_lens, block_size, num_blocks):
    """Whether a decode batch's values are in range: every slot in the cache, every position in the
    RoPE tables, every block table (``_table_problem``). One compiled pass over what check_write_kv,
    check_rope and paged_decode_rows test with NumPy reductions; a fused decode step
    (cpu/fused_decode.py) runs it every step and those checks, for their message, only when it fails."""
    for t in range(len(slot_mapping)):
        if not (0 <= slot_mapping[t] < n_slots and 0 <= positions[t] < n_positions):
            return False
    return _table_problem(block_tables, seq_lens, block_size, num_blocks) == TABLE_OK


def check_query_starts(q: np.ndarray, query_starts: np.ndarray, context_lens: np.ndarray) -> None:
    if query_starts.shape != (len(context_lens) + 1,) or query_starts[0] != 0 or query_starts[-1] != len(q):
        raise ValueError(f"query_starts must be (B+1,) = 0 .. {len(q)} for B = {len(context_lens)} sequences, "
                         f"got {query_starts}")
    if (np.diff(query_starts) < 1).any() or (context_lens < 0).any():
        raise ValueError(f"every sequence needs >= 1 new query and context_len >= 0, got query_starts "
                         f"{query_starts}, context_lens {context_lens}")


# the flat view of a paged batch that the CPU and CUDA kernels share: one entry per query row


def paged_decode_rows(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                context_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Check a decode batch q (B, H, Dh) -> block_tables, query_seq (B,), query_keys (B,), the kernel's
    view of it: query b belongs to sequence b and sees all its keys (the CPU and CUDA kernels share this)."""
    context_lens = np.asarray(context_lens, dtype=np.int64)  # (B,) keys each query sees, its own included
    block_tables = np.asarray(block_tables)                  # (B, max_blocks)
    check_paged_attention(q, k_cache, v_cache, block_tables, context_lens)
    if len(q) != len(context_lens):
        raise ValueError(f"paged decode: {len(q)} queries for {len(context_lens)} sequences")
    return block_tables, np.arange(len(q)), context_lens


def paged_prefill_rows(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                 query_starts: np.ndarray, context_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Check prefill chunks q (N, H, Dh) -> block_tables, query_seq (N,), query_keys (N,): row i belongs to
    sequence query_seq[i] and, being causal, sees its keys up to its own position."""
    query_starts = np.asarray(query_starts, dtype=np.int64)  # (B+1,)
    context_lens = np.asarray(context_lens, dtype=np.int64)  # (B,) keys cached before the chunk
    block_tables = np.asarray(block_tables)                  # (B, max_blocks)
    check_query_starts(q, query_starts, context_lens)
    query_lens = np.diff(query_starts)                       # (B,)
    check_paged_attention(q, k_cache, v_cache, block_tables, context_lens + query_lens)
    query_seq = np.repeat(np.arange(len(query_lens)), query_lens)  # (N,) the sequence of each query
    positions = context_lens[query_seq] + np.arange(len(q)) - query_starts[query_seq]  # (N,)
    return block_tables, query_seq, positions + 1  # sees keys 0..position
