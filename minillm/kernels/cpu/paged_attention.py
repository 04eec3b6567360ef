"""Paged attention: attention over keys and values scattered in fixed-size blocks.

The paged KV cache stores, per layer, K and V each as (num_blocks, block_size, Hkv, Dh). A
sequence's keys are not contiguous: its *block table* lists the physical blocks holding its
tokens 0..bs-1, bs..2bs-1, ... in order, so token t lives at

    block_tables[b, t // bs], offset t % bs      (its "slot" is block * bs + offset)

Attention itself is unchanged - only the address of key t is one table lookup away. The NumPy
specification (reference.paged_attention_decode / _prefill) gathers the blocks into a contiguous
buffer and calls the contiguous attention; these Numba kernels walk the block table in place:

    write_kv                  scatter a batch's new K/V into their slots (a compiled row copy)
    paged_attention_decode    one query per sequence over its blocks
    paged_attention_prefill   a chunk of new queries per sequence, on top of a cached prefix,
                              causal within the chunk: tiles of queries against tiles of keys

Decode runs one kernel in which each query row knows its sequence and how many keys it sees;
prefill has its own, tiled as two matmuls. Grouped-query attention indexes the shared KV head
(h // group) rather than repeating K/V. Numba does not bounds-check, so every wrapper checks
shapes, dtypes, lengths and block ids first (shapes.py, shared with the reference and CUDA).
"""
from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

from minillm.kernels import shapes
from minillm.kernels.cpu.matmul_ladder import matmul_nt_into
from minillm.kernels.cpu.rows import KERNEL, fast_exp, float32_max

# -----------------------------------------------------------------------------
# writing: a scatter through the slot mapping


def write_kv(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray, slot_mapping: np.ndarray) -> None:
    """Numba version of reference.write_kv: k, v (N, Hkv, Dh) into their slots (N,), in place.

    Seen as (num_blocks * block_size, Hkv, Dh) the cache has one row per slot, so the write is a
    row copy per slot. NumPy's fancy-index scatter did it at 0.4 GB/s (2 ms for a 512-token
    SmolLM2 chunk, 2-core Zen 4), a compiled loop of row copies 20x faster.
    """
    slot_mapping = np.asarray(slot_mapping)
    shapes.check_write_kv(k_cache, v_cache, k, v, slot_mapping)
    shapes.check_contiguous_cache(k_cache, v_cache)
    num_blocks, block_size, n_kv_heads, head_dim = k_cache.shape
    scatter_rows(k_cache.reshape(num_blocks * block_size, n_kv_heads * head_dim),  # (num_slots, Hkv*Dh) view
                 np.ascontiguousarray(k, dtype=np.float32).reshape(len(slot_mapping), -1), slot_mapping.astype(np.int64))
    scatter_rows(v_cache.reshape(num_blocks * block_size, n_kv_heads * head_dim),
                 np.ascontiguousarray(v, dtype=np.float32).reshape(len(slot_mapping), -1), slot_mapping.astype(np.int64))


@njit(**KERNEL)
def scatter_rows(table, rows, slots):
    """table[slots[i]] = rows[i] for every i. table (num_slots, W); rows (N, W); slots (N,) checked."""
    for i in range(len(slots)):
        table[slots[i], :] = rows[i]


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
def paged_attention_kernel(q, k_cache, v_cache, block_tables, query_seq, query_keys, n_chunks, scale, out):
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


# -----------------------------------------------------------------------------
# prefill: the same online softmax, but tiles of queries against tiles of keys, as two matmuls
#
# The per-row kernel above computes one dot product at a time, each ending in a horizontal sum:
# 24 GFLOP/s on a 512-token SmolLM2 prefill (2-core Zen 4), a quarter of the prompt's time. Here
# a job holds a tile of queries of one kv head - PREFILL_QUERY_TILE tokens x its group of query
# heads, stacked as rows - and walks the sequence's keys PREFILL_KEY_TILE at a time, gathered
# from their blocks into contiguous scratch: scores = Q K^T and acc += P V are both
# matmul_nt_into calls (cpu/matmul_ladder.py's 4 x 4 register tiles), and each gathered key and value
# serves every row of the tile.

PREFILL_QUERY_TILE = 32  # query tokens per job (x group heads = rows of the score tile)
PREFILL_KEY_TILE = 64    # keys per step: the gathered K and V^T tiles, 16 KB each, stay in L1


@njit(**KERNEL)
def _prefill_job(q, k_cache, v_cache, table, first_row, context_len, t0, t1, kv_head, scale, out):
    """Queries t0..t1-1 (chunk-relative) of one sequence, the heads of kv_head -> out rows."""
    head_dim = q.shape[2]
    group = q.shape[1] // k_cache.shape[2]
    block_size = k_cache.shape[1]
    n_rows = (t1 - t0) * group                                       # row r: token t0 + r // group, head r % group
    qs = np.empty((n_rows, head_dim), dtype=np.float32)              # (R, Dh) queries, pre-scaled
    for r in range(n_rows):
        for d in range(head_dim):
            qs[r, d] = q[first_row + t0 + r // group, kv_head * group + r % group, d] * scale
    kt = np.zeros((PREFILL_KEY_TILE, head_dim), dtype=np.float32)   # (BK, Dh) keys of this step
    vt = np.zeros((head_dim, PREFILL_KEY_TILE), dtype=np.float32)   # (Dh, BK) values, transposed
    s = np.empty((n_rows, PREFILL_KEY_TILE), dtype=np.float32)      # (R, BK) scores, then weights
    pv = np.empty((n_rows, head_dim), dtype=np.float32)             # (R, Dh) this step's P V
    acc = np.zeros((n_rows, head_dim), dtype=np.float32)            # (R, Dh) unnormalised outputs
    m = np.full(n_rows, -np.inf, dtype=np.float32)                  # (R,) running max
    l = np.zeros(n_rows, dtype=np.float32)                          # (R,) running sum of weights
    last_key = context_len + t1                                     # keys 0..last_key-1 are seen
    for k0 in range(0, last_key, PREFILL_KEY_TILE):
        nk = min(PREFILL_KEY_TILE, last_key - k0)
        for j in range(PREFILL_KEY_TILE):                           # gather; zeros past the end
            if j < nk:
                token = k0 + j
                block, offset = table[token // block_size], token % block_size
                for d in range(head_dim):
                    kt[j, d] = k_cache[block, offset, kv_head, d]
                    vt[d, j] = v_cache[block, offset, kv_head, d]
            else:
                kt[j, :] = 0.0
                vt[:, j] = 0.0
        matmul_nt_into(qs, kt, s)                                   # (R, BK) = Q K^T
        for r in range(n_rows):
            visible = min(nk, context_len + t0 + r // group - k0 + 1)  # causal: keys up to its position
            row = s[r]
            if visible <= 0:                                        # the whole tile lies in its future
                row[:] = 0.0
                continue
            new_m = m[r]
            for j in range(visible):
                new_m = float32_max(new_m, row[j])
            alpha = fast_exp(m[r] - new_m)                          # 0 on the row's first tile
            total = np.float32(0.0)
            for j in range(PREFILL_KEY_TILE):
                p = fast_exp(row[j] - new_m) if j < visible else np.float32(0.0)
                row[j] = p
                total += p
            l[r] = l[r] * alpha + total
            m[r] = new_m
            for d in range(head_dim):
                acc[r, d] *= alpha
        matmul_nt_into(s, vt, pv)                                   # (R, Dh) = P V
        for r in range(n_rows):
            for d in range(head_dim):
                acc[r, d] += pv[r, d]
    for r in range(n_rows):
        inv_l = np.float32(1.0) / l[r]
        for d in range(head_dim):
            out[first_row + t0 + r // group, kv_head * group + r % group, d] = acc[r, d] * inv_l


@njit(parallel=True, **KERNEL)
def paged_prefill_kernel(q, k_cache, v_cache, block_tables, query_starts, context_lens,
                         job_seq, job_t0, scale, out):
    """Every (query tile, kv head) job of a prefill batch. job_seq, job_t0 (J,) name each tile."""
    n_kv_heads = k_cache.shape[2]
    for job in prange(len(job_seq) * n_kv_heads):
        tile, kv_head = job // n_kv_heads, job % n_kv_heads
        b, t0 = job_seq[tile], job_t0[tile]
        t1 = min(t0 + PREFILL_QUERY_TILE, query_starts[b + 1] - query_starts[b])
        _prefill_job(q, k_cache, v_cache, block_tables[b], query_starts[b], context_lens[b], t0, t1,
                     kv_head, scale, out)


def prefill_jobs(query_starts: np.ndarray, context_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sequence, first query) of every query tile, ordered so that equal runs of jobs cost alike.

    Numba splits a prange into one contiguous run per thread, and a causal tile's cost grows with
    its position; listing the tiles longest, shortest, second longest, ... gives every run a mix.
    """
    seqs, starts, cost = [], [], []
    for b in range(len(context_lens)):
        for t0 in range(0, int(query_starts[b + 1] - query_starts[b]), PREFILL_QUERY_TILE):
            seqs.append(b)
            starts.append(t0)
            cost.append(int(context_lens[b]) + t0)
    order = np.argsort(cost, kind="stable")[::-1]           # longest first
    zigzag = np.empty_like(order)
    zigzag[0::2], zigzag[1::2] = order[: (len(order) + 1) // 2], order[(len(order) + 1) // 2:][::-1]
    return np.asarray(seqs, dtype=np.int64)[zigzag], np.asarray(starts, dtype=np.int64)[zigzag]


def key_chunks(n_queries: int, n_kv_heads: int, query_keys: np.ndarray) -> int:
    """Chunks each query's keys are split into: more than one only when the (query row, kv head)
    jobs are too few to fill the cores."""
    few_jobs = n_queries * n_kv_heads < 4 * numba.get_num_threads()
    return max(1, int(query_keys.max()) // SPLIT_MIN_KEYS) if few_jobs else 1


def _run_kernel(q, k_cache, v_cache, block_tables, query_seq, query_keys, scale):
    """Choose the chunking, then run the kernel. query_seq, query_keys (N,)."""
    scale = 1 / math.sqrt(q.shape[2]) if scale is None else scale
    n_chunks = key_chunks(len(q), k_cache.shape[2], query_keys)
    out = np.empty_like(q)  # (N, H, Dh)
    paged_attention_kernel(np.ascontiguousarray(q), k_cache, v_cache,
                           np.ascontiguousarray(block_tables, dtype=np.int32),
                           query_seq.astype(np.int64), query_keys.astype(np.int64), n_chunks,
                           np.float32(scale), out)
    return out


def paged_attention_decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                           context_lens: np.ndarray, scale: float | None = None) -> np.ndarray:
    """Numba version of reference.paged_attention_decode: q (B, H, Dh) -> (B, H, Dh)."""
    return _run_kernel(q, k_cache, v_cache, *shapes.paged_decode_rows(q, k_cache, v_cache, block_tables, context_lens), scale)


def paged_attention_prefill(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                            query_starts: np.ndarray, context_lens: np.ndarray,
                            scale: float | None = None) -> np.ndarray:
    """Numba version of reference.paged_attention_prefill: q (N, H, Dh) -> (N, H, Dh)."""
    block_tables, _, _ = shapes.paged_prefill_rows(q, k_cache, v_cache, block_tables, query_starts, context_lens)
    query_starts = np.asarray(query_starts, dtype=np.int64)  # (B+1,)
    context_lens = np.asarray(context_lens, dtype=np.int64)  # (B,)
    scale = 1 / math.sqrt(q.shape[2]) if scale is None else scale
    out = np.empty_like(q)  # (N, H, Dh)
    paged_prefill_kernel(np.ascontiguousarray(q), k_cache, v_cache, np.ascontiguousarray(block_tables, dtype=np.int32),
                         query_starts, context_lens, *prefill_jobs(query_starts, context_lens),
                         np.float32(scale), out)
    return out
