"""Paged attention: attention over keys and values scattered in fixed-size blocks.

The paged KV cache stores, per layer, K and V each as (num_blocks, block_size, Hkv, Dh). A
sequence's keys are not contiguous: its *block table* lists the physical blocks holding its
tokens 0..bs-1, bs..2bs-1, ... in order, so token t lives at

    block_tables[b, t // bs], offset t % bs      (its "slot" is block * bs + offset)

Attention itself is unchanged - only the address of key t is one table lookup away. The two
attentions each come as a NumPy reference (the specification: gather the blocks into a
contiguous buffer, then call the contiguous attention of reference.py) and a Numba kernel (no
gather: it walks the block table in place):

    write_kv                  scatter a batch's new K/V into their slots (one NumPy scatter)
    paged_attention_decode    one query per sequence over its blocks
    paged_attention_prefill   a chunk of new queries per sequence, on top of a cached prefix,
                              causal within the chunk

One Numba kernel serves both: each query row knows its sequence and how many keys it sees
(decode: all of them; prefill: its own position + 1). Grouped-query attention indexes the
shared KV head (h // group) rather than repeating K/V. Numba does not bounds-check, so every
wrapper checks shapes, dtypes, lengths and block ids in Python first.
"""
from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

from minillm.kernels import reference
from minillm.kernels.cpu_rows import KERNEL, fast_exp, float32_max

# -----------------------------------------------------------------------------
# argument checks: a bad block table must fail here, not read random memory in a kernel


def _check_cache(k_cache: np.ndarray, v_cache: np.ndarray) -> None:
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"paged K/V caches must share one shape (num_blocks, block_size, Hkv, Dh), "
                         f"got {k_cache.shape} and {v_cache.shape}")
    if k_cache.dtype != np.float32 or v_cache.dtype != np.float32:
        raise ValueError(f"paged K/V caches must be float32, got {k_cache.dtype} and {v_cache.dtype}")


def _check_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                     seq_lens: np.ndarray) -> None:
    """q (., H, Dh); block_tables (B, max_blocks); seq_lens (B,) keys each sequence holds."""
    _check_cache(k_cache, v_cache)
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
    if (seq_lens < 1).any() or (seq_lens > block_tables.shape[1] * block_size).any():
        raise ValueError(f"every sequence must hold between 1 and {block_tables.shape[1]} blocks x "
                         f"{block_size} tokens of keys, got lengths {seq_lens}")
    used = np.arange(block_tables.shape[1]) < -(-seq_lens[:, None] // block_size)  # (B, max_blocks)
    blocks = block_tables[used]                                                   # the entries read
    if blocks.min() < 0 or blocks.max() >= num_blocks:
        raise ValueError(f"block tables name blocks {blocks.min()}..{blocks.max()}, "
                         f"but the cache has {num_blocks} blocks")


def _check_query_starts(q: np.ndarray, query_starts: np.ndarray, context_lens: np.ndarray) -> None:
    if query_starts.shape != (len(context_lens) + 1,) or query_starts[0] != 0 or query_starts[-1] != len(q):
        raise ValueError(f"query_starts must be (B+1,) = 0 .. {len(q)} for B = {len(context_lens)} sequences, "
                         f"got {query_starts}")
    if (np.diff(query_starts) < 1).any() or (context_lens < 0).any():
        raise ValueError(f"every sequence needs >= 1 new query and context_len >= 0, got query_starts "
                         f"{query_starts}, context_lens {context_lens}")


# -----------------------------------------------------------------------------
# writing: a scatter through the slot mapping


def write_kv(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray, slot_mapping: np.ndarray) -> None:
    """Store new keys and values k, v (N, Hkv, Dh) at their slots (N,), in place.

    Seen as (num_blocks * block_size, Hkv, Dh) the cache has one row per slot, so the write is
    one vectorised NumPy scatter - already a memcpy per row; a compiled loop would gain nothing.
    """
    _check_cache(k_cache, v_cache)
    num_blocks, block_size, n_kv_heads, head_dim = k_cache.shape
    slot_mapping = np.asarray(slot_mapping)
    if k.shape != v.shape or k.shape != (len(slot_mapping), n_kv_heads, head_dim):
        raise ValueError(f"write_kv needs k and v ({len(slot_mapping)}, {n_kv_heads}, {head_dim}), one row "
                         f"per slot, got {k.shape} and {v.shape}")
    if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        raise ValueError("write_kv needs C-contiguous caches (a reshaped copy would swallow the write)")
    if slot_mapping.size and (slot_mapping.min() < 0 or slot_mapping.max() >= num_blocks * block_size):
        raise ValueError(f"slots must lie in [0, {num_blocks * block_size}), "
                         f"got {slot_mapping.min()}..{slot_mapping.max()}")
    k_cache.reshape(num_blocks * block_size, n_kv_heads, head_dim)[slot_mapping] = k  # (num_slots, Hkv, Dh) view
    v_cache.reshape(num_blocks * block_size, n_kv_heads, head_dim)[slot_mapping] = v  # (num_slots, Hkv, Dh) view


# -----------------------------------------------------------------------------
# the reference: gather a sequence's blocks, then attend as if the cache were contiguous


def gather_kv(k_cache: np.ndarray, v_cache: np.ndarray, block_table: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The first seq_len keys and values of one sequence, in token order -> k, v (seq_len, Hkv, Dh)."""
    num_blocks, block_size, n_kv_heads, head_dim = k_cache.shape
    blocks = block_table[: -(-seq_len // block_size)]                                  # (n_blocks,)
    k = k_cache[blocks].reshape(-1, n_kv_heads, head_dim)[:seq_len]  # (seq_len, Hkv, Dh) blocks laid end to end
    v = v_cache[blocks].reshape(-1, n_kv_heads, head_dim)[:seq_len]  # (seq_len, Hkv, Dh)
    return k, v


def paged_attention_decode_reference(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                                     block_tables: np.ndarray, context_lens: np.ndarray,
                                     scale: float | None = None) -> np.ndarray:
    """One query per sequence, q (B, H, Dh), over the first context_lens[b] keys of its blocks -> (B, H, Dh)."""
    context_lens = np.asarray(context_lens, dtype=np.int64)  # (B,) keys each query sees, its own included
    block_tables = np.asarray(block_tables)                  # (B, max_blocks)
    _check_attention(q, k_cache, v_cache, block_tables, context_lens)
    if len(q) != len(context_lens):
        raise ValueError(f"paged decode: {len(q)} queries for {len(context_lens)} sequences")
    out = np.empty_like(q)  # (B, H, Dh)
    for b, n in enumerate(context_lens):
        k, v = gather_kv(k_cache, v_cache, block_tables[b], n)        # (n, Hkv, Dh) each
        out[b] = reference.attention_decode(q[b], k, v, n, scale)     # (H, Dh)
    return out


def paged_attention_prefill_reference(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                                      block_tables: np.ndarray, query_starts: np.ndarray,
                                      context_lens: np.ndarray, scale: float | None = None) -> np.ndarray:
    """New queries q (N, H, Dh) of B sequences, each chunk on top of context_lens[b] cached keys -> (N, H, Dh).

    Sequence b owns rows query_starts[b]:query_starts[b+1]; its query t sits at position
    context_lens[b] + t and sees keys 0 .. context_lens[b] + t. The chunk's own K/V must already
    be written (write_kv) - the cache holds context_lens[b] + chunk length keys.
    """
    query_starts = np.asarray(query_starts, dtype=np.int64)  # (B+1,)
    context_lens = np.asarray(context_lens, dtype=np.int64)  # (B,) keys cached before the chunk
    block_tables = np.asarray(block_tables)                  # (B, max_blocks)
    _check_query_starts(q, query_starts, context_lens)
    seq_lens = context_lens + np.diff(query_starts)          # (B,) keys after the chunk
    _check_attention(q, k_cache, v_cache, block_tables, seq_lens)
    out = np.empty_like(q)  # (N, H, Dh)
    for b, n in enumerate(seq_lens):
        rows = slice(query_starts[b], query_starts[b + 1])
        k, v = gather_kv(k_cache, v_cache, block_tables[b], n)                     # (n, Hkv, Dh) each
        out[rows] = reference.attention(q[rows], k, v, context_lens[b], scale)      # (T, H, Dh)
    return out


# -----------------------------------------------------------------------------
# the Numba kernels: walk the block table in place
#
# A job is (query row, kv head, chunk of keys): it loads each key and value row once for all the
# query heads sharing that kv head (GQA), and leaves per head a running max m, a sum l of
# exp(score - m) and an unnormalised output acc. A second pass merges the chunks of each head,
# rescaling each by exp(m_chunk - m_all). Long decodes are split into chunks so that a batch of
# one sequence still has a job for every core (flash-decoding); prefill has rows enough.

SPLIT_MIN_KEYS = 256  # a chunk covers at least this many keys, or merging costs more than it saves


@njit(**KERNEL)
def _attend_chunk(q, k_cache, v_cache, table, i, kv_head, s0, s1, scale, m_out, l_out, acc_out):
    """Query row i's heads of kv_head over keys s0..s1-1 of one sequence: per head m, l and acc.

    q (N, H, Dh); k_cache, v_cache (num_blocks, bs, Hkv, Dh); table (max_blocks,) the sequence's
    blocks; m_out, l_out (group,); acc_out (group, Dh). An empty chunk leaves m = -inf, l = 0.
    """
    group, head_dim = acc_out.shape
    block_size = k_cache.shape[1]
    h0 = kv_head * group                               # the first query head of this kv head
    scores = np.empty((group, s1 - s0), dtype=np.float32)  # (group, keys) this chunk's scores
    for block_index in range(s0 // block_size, (s1 + block_size - 1) // block_size):
        block, first = table[block_index], block_index * block_size
        for t in range(max(s0, first), min(s1, first + block_size)):  # tokens of one block: contiguous rows
            key = k_cache[block, t - first, kv_head]   # (Dh,)
            for g in range(group):
                query = q[i, h0 + g]                   # (Dh,)
                dot = np.float32(0.0)
                for d in range(head_dim):
                    dot += query[d] * key[d]
                scores[g, t - s0] = dot * scale
    for g in range(group):
        m = np.float32(-np.inf)
        for j in range(s1 - s0):
            m = float32_max(m, scores[g, j])
        total = np.float32(0.0)
        for j in range(s1 - s0):
            p = fast_exp(scores[g, j] - m)             # in (0, 1]: the max was subtracted
            scores[g, j] = p                           # the score becomes its unnormalised weight
            total += p
        m_out[g], l_out[g] = m, total
    acc_out[:, :] = 0.0
    for block_index in range(s0 // block_size, (s1 + block_size - 1) // block_size):
        block, first = table[block_index], block_index * block_size
        for t in range(max(s0, first), min(s1, first + block_size)):
            value = v_cache[block, t - first, kv_head]  # (Dh,)
            for g in range(group):
                p = scores[g, t - s0]
                for d in range(head_dim):
                    acc_out[g, d] += p * value[d]


@njit(parallel=True, **KERNEL)
def _paged_attention_kernel(q, k_cache, v_cache, block_tables, query_seq, query_keys, n_chunks, scale, out):
    """out[i, h] = softmax(scale q[i, h] . K) V over the first query_keys[i] keys of sequence query_seq[i].

    q, out (N, H, Dh); block_tables (B, max_blocks) int32; query_seq, query_keys (N,) int64.
    """
    n_queries, n_heads, head_dim = q.shape
    n_kv_heads = k_cache.shape[2]
    group = n_heads // n_kv_heads                      # query heads per kv head
    m = np.empty((n_queries, n_kv_heads, n_chunks, group), dtype=np.float32)      # running maxima
    l = np.empty((n_queries, n_kv_heads, n_chunks, group), dtype=np.float32)      # sums of weights
    acc = np.empty((n_queries, n_kv_heads, n_chunks, group, head_dim), dtype=np.float32)  # outputs
    for job in prange(n_queries * n_kv_heads * n_chunks):
        i, rest = job // (n_kv_heads * n_chunks), job % (n_kv_heads * n_chunks)
        kv_head, c = rest // n_chunks, rest % n_chunks
        n = query_keys[i]
        s0, s1 = c * n // n_chunks, (c + 1) * n // n_chunks  # the last chunk is never empty
        _attend_chunk(q, k_cache, v_cache, block_tables[query_seq[i]], i, kv_head, s0, s1, scale,
                      m[i, kv_head, c], l[i, kv_head, c], acc[i, kv_head, c])
    for job in prange(n_queries * n_heads):            # merge the chunks of each head
        i, h = job // n_heads, job % n_heads
        kv_head, g = h // group, h % group
        m_all = np.float32(-np.inf)
        for c in range(n_chunks):
            m_all = float32_max(m_all, m[i, kv_head, c, g])
        total = np.float32(0.0)
        out[i, h, :] = 0.0
        for c in range(n_chunks):
            w = fast_exp(m[i, kv_head, c, g] - m_all)  # rescale the chunk to the common max
            total += w * l[i, kv_head, c, g]
            for d in range(head_dim):
                out[i, h, d] += w * acc[i, kv_head, c, g, d]
        for d in range(head_dim):
            out[i, h, d] /= total


def _run_kernel(q, k_cache, v_cache, block_tables, query_seq, query_keys, scale):
    """Choose the chunking, then run the kernel. query_seq, query_keys (N,)."""
    scale = 1 / math.sqrt(q.shape[2]) if scale is None else scale
    few_jobs = len(q) * k_cache.shape[2] < 4 * numba.get_num_threads()  # too few (row, kv head) jobs to fill the cores
    n_chunks = max(1, int(query_keys.max()) // SPLIT_MIN_KEYS) if few_jobs else 1
    out = np.empty_like(q)  # (N, H, Dh)
    _paged_attention_kernel(np.ascontiguousarray(q), k_cache, v_cache,
                            np.ascontiguousarray(block_tables, dtype=np.int32),
                            query_seq.astype(np.int64), query_keys.astype(np.int64), n_chunks,
                            np.float32(scale), out)
    return out


def decode_rows(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                context_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Check a decode batch q (B, H, Dh) -> block_tables, query_seq (B,), query_keys (B,), the kernel's
    view of it: query b belongs to sequence b and sees all its keys (the CPU and CUDA kernels share this)."""
    context_lens = np.asarray(context_lens, dtype=np.int64)  # (B,) keys each query sees, its own included
    block_tables = np.asarray(block_tables)                  # (B, max_blocks)
    _check_attention(q, k_cache, v_cache, block_tables, context_lens)
    if len(q) != len(context_lens):
        raise ValueError(f"paged decode: {len(q)} queries for {len(context_lens)} sequences")
    return block_tables, np.arange(len(q)), context_lens


def prefill_rows(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                 query_starts: np.ndarray, context_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Check prefill chunks q (N, H, Dh) -> block_tables, query_seq (N,), query_keys (N,): row i belongs to
    sequence query_seq[i] and, being causal, sees its keys up to its own position."""
    query_starts = np.asarray(query_starts, dtype=np.int64)  # (B+1,)
    context_lens = np.asarray(context_lens, dtype=np.int64)  # (B,) keys cached before the chunk
    block_tables = np.asarray(block_tables)                  # (B, max_blocks)
    _check_query_starts(q, query_starts, context_lens)
    query_lens = np.diff(query_starts)                       # (B,)
    _check_attention(q, k_cache, v_cache, block_tables, context_lens + query_lens)
    query_seq = np.repeat(np.arange(len(query_lens)), query_lens)  # (N,) the sequence of each query
    positions = context_lens[query_seq] + np.arange(len(q)) - query_starts[query_seq]  # (N,)
    return block_tables, query_seq, positions + 1  # sees keys 0..position


def paged_attention_decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                           context_lens: np.ndarray, scale: float | None = None) -> np.ndarray:
    """Numba version of paged_attention_decode_reference: q (B, H, Dh) -> (B, H, Dh)."""
    return _run_kernel(q, k_cache, v_cache, *decode_rows(q, k_cache, v_cache, block_tables, context_lens), scale)


def paged_attention_prefill(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                            query_starts: np.ndarray, context_lens: np.ndarray,
                            scale: float | None = None) -> np.ndarray:
    """Numba version of paged_attention_prefill_reference: q (N, H, Dh) -> (N, H, Dh)."""
    rows = prefill_rows(q, k_cache, v_cache, block_tables, query_starts, context_lens)
    return _run_kernel(q, k_cache, v_cache, *rows, scale)
