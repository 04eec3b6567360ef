"""Attention on the CPU as Numba kernels: the decode step and the tiled (flash) prefill.

Both use the online softmax: keys are visited in tiles, and each query keeps a running max m,
a running sum l of exp(score - m) and an unnormalised output acc; when a tile raises the max,
l and acc are rescaled by exp(m_old - m_new). The T x S score matrix is never stored: one row
of one tile at a time (64 floats) is all that exists, in L1.

Grouped-query attention is done by indexing: query head h reads kv head h // group. K and V are
never repeated in memory, and a kv head's keys are loaded once for all the query heads it serves.

Numba's cache=True does not notice when fast_exp (in cpu/rows.py) changes: after editing it,
delete minillm/kernels/__pycache__/cpu_attention*.nb* so these kernels recompile.
"""
import numpy as np
from numba import njit, prange

from minillm.kernels.cpu.rows import KERNEL, fast_exp, float32_max

SPLIT_MIN_KEYS = 256   # decode: a kv head's keys are split into chunks of at least this many per job
QUERY_TILE = 32        # prefill: queries per job (rows of the score tile)
KEY_TILE = 64          # prefill: keys per step; the tile's keys (64 x 64 floats, 16 KB) stay in L1


# -----------------------------------------------------------------------------
# decode: one query per head, flash-decoding style (keys split over the cores)


@njit(**KERNEL)
def _decode_chunk(q, k, v, kvh, s0, s1, scale, m_out, l_out, acc_out):
    """The query heads of kv head kvh over keys s0..s1: per head its max, sum and unnormalised output.

    q (H, Dh); k, v (S, Hkv, Dh); m_out, l_out (group,); acc_out (group, Dh).
    """
    group = m_out.shape[0]
    Dh = q.shape[1]
    scores = np.empty((group, s1 - s0), dtype=np.float32)  # (group, n) one chunk of scores
    for s in range(s0, s1):  # each key row is loaded once for the whole group
        for g in range(group):
            dot = np.float32(0.0)
            for d in range(Dh):
                dot += q[kvh * group + g, d] * k[s, kvh, d]
            scores[g, s - s0] = dot * scale
    for g in range(group):
        m = scores[g, 0]
        for j in range(s1 - s0):
            m = max(m, scores[g, j])
        total = np.float32(0.0)
        for j in range(s1 - s0):
            p = fast_exp(scores[g, j] - m)
            scores[g, j] = p  # the score becomes its unnormalised weight
            total += p
        m_out[g], l_out[g] = m, total
        acc_out[g, :] = 0.0
    for s in range(s0, s1):  # each value row is loaded once for the whole group
        for g in range(group):
            p = scores[g, s - s0]
            for d in range(Dh):
                acc_out[g, d] += p * v[s, kvh, d]


@njit(**KERNEL)
def _decode_combine(m, l, acc, out):
    """Merge the chunks of every head: m, l (Hkv, n_chunks, group), acc (Hkv, n_chunks, group, Dh) -> out (H, Dh)."""
    n_kv, n_chunks, group = m.shape
    for kvh in range(n_kv):
        for g in range(group):
            m_all = m[kvh, 0, g]
            for c in range(n_chunks):
                m_all = max(m_all, m[kvh, c, g])
            total = np.float32(0.0)
            row = out[kvh * group + g]  # (Dh,)
            row[:] = 0.0
            for c in range(n_chunks):
                w = fast_exp(m[kvh, c, g] - m_all)  # rescale each chunk to the common max
                total += w * l[kvh, c, g]
                for d in range(row.shape[0]):
                    row[d] += w * acc[kvh, c, g, d]
            row *= np.float32(1.0) / total


@njit(**KERNEL)
def _decode_buffers(q, k, kv_len):
    n_kv = k.shape[1]
    group = q.shape[0] // n_kv
    n_chunks = max(1, kv_len // SPLIT_MIN_KEYS)
    m = np.empty((n_kv, n_chunks, group), dtype=np.float32)              # (Hkv, C, group)
    l = np.empty((n_kv, n_chunks, group), dtype=np.float32)              # (Hkv, C, group)
    acc = np.empty((n_kv, n_chunks, group, q.shape[1]), dtype=np.float32)  # (Hkv, C, group, Dh)
    return m, l, acc


@njit(**KERNEL)
def attention_decode_serial(q, k, v, kv_len, scale):
    m, l, acc = _decode_buffers(q, k, kv_len)
    n_kv, n_chunks = m.shape[0], m.shape[1]
    for job in range(n_kv * n_chunks):
        kvh, c = job // n_chunks, job % n_chunks
        s0, s1 = c * kv_len // n_chunks, (c + 1) * kv_len // n_chunks
        _decode_chunk(q, k, v, kvh, s0, s1, scale, m[kvh, c], l[kvh, c], acc[kvh, c])
    out = np.empty_like(q)  # (H, Dh)
    _decode_combine(m, l, acc, out)
    return out


@njit(parallel=True, **KERNEL)
def attention_decode_parallel(q, k, v, kv_len, scale):
    m, l, acc = _decode_buffers(q, k, kv_len)
    n_kv, n_chunks = m.shape[0], m.shape[1]
    for job in prange(n_kv * n_chunks):  # (kv head, key chunk) pairs: work for every core
        kvh, c = job // n_chunks, job % n_chunks
        s0, s1 = c * kv_len // n_chunks, (c + 1) * kv_len // n_chunks
        _decode_chunk(q, k, v, kvh, s0, s1, scale, m[kvh, c], l[kvh, c], acc[kvh, c])
    out = np.empty_like(q)  # (H, Dh)
    _decode_combine(m, l, acc, out)
    return out


# -----------------------------------------------------------------------------
# prefill: tiles of queries against tiles of keys, causal, online softmax


@njit(**KERNEL)
def _prefill_tile(q, kt, v, start, scale, h, t0, t1, out):
    """Queries t0..t1 of head h over every key they may see -> out[t0:t1, h]. kt (Hkv, Dh, L)."""
    Dh = q.shape[2]
    kvh = h // (q.shape[1] // kt.shape[0])
    nq = t1 - t0
    qs = np.empty((nq, Dh), dtype=np.float32)       # (nq, Dh) the queries, pre-scaled
    for i in range(nq):
        for d in range(Dh):
            qs[i, d] = q[t0 + i, h, d] * scale
    acc = np.zeros((nq, Dh), dtype=np.float32)      # (nq, Dh) unnormalised outputs
    m = np.full(nq, -np.inf, dtype=np.float32)      # (nq,) running max
    l = np.zeros(nq, dtype=np.float32)              # (nq,) running sum
    p = np.empty(KEY_TILE, dtype=np.float32)         # (BK,) one row of scores, then of weights
    last_key = start + t1                            # keys 0 .. last_key-1 are seen by some query
    for k0 in range(0, last_key, KEY_TILE):
        nk = min(KEY_TILE, last_key - k0)
        for i in range(nq):
            visible = min(nk, start + t0 + i - k0 + 1)  # causal: key k0+j is seen if k0+j <= start+t0+i
            if visible <= 0:
                continue
            row = p[:visible]                       # (visible,)
            row[:] = 0.0
            for d in range(Dh):                     # scores = q_i . k_j, streaming along keys
                qd, kd = qs[i, d], kt[kvh, d, k0:k0 + visible]
                for j in range(visible):
                    row[j] += qd * kd[j]
            new_m = m[i]
            for j in range(visible):
                new_m = float32_max(new_m, row[j])
            alpha = fast_exp(m[i] - new_m)          # rescales the old sum and output; 0 on the first tile
            total = np.float32(0.0)
            for j in range(visible):                # a vector loop of exps
                row[j] = fast_exp(row[j] - new_m)
                total += row[j]
            l[i] = l[i] * alpha + total
            m[i] = new_m
            out_i = acc[i]                          # (Dh,)
            for d in range(Dh):
                out_i[d] *= alpha
            for j in range(visible):                # acc_i += sum_j p_j v_j
                pj, vj = row[j], v[k0 + j, kvh]
                for d in range(Dh):
                    out_i[d] += pj * vj[d]
    for i in range(nq):
        inv_l = np.float32(1.0) / l[i]
        for d in range(Dh):
            out[t0 + i, h, d] = acc[i, d] * inv_l


@njit(parallel=True, **KERNEL)
def attention_prefill(q, k, v, start, scale):
    """q (T, H, Dh); k, v (S, Hkv, Dh) -> (T, H, Dh); one job per (head, query tile)."""
    T, H = q.shape[0], q.shape[1]
    L = start + T                                          # keys seen by the last query
    kt = np.empty((k.shape[1], k.shape[2], L), dtype=np.float32)  # (Hkv, Dh, L) keys transposed once,
    for s in range(L):                                     # so score loops run along contiguous keys
        for kvh in range(k.shape[1]):
            for d in range(k.shape[2]):
                kt[kvh, d, s] = k[s, kvh, d]
    out = np.empty_like(q)  # (T, H, Dh)
    n_tiles = (T + QUERY_TILE - 1) // QUERY_TILE
    for job in prange(H * n_tiles):  # head-major: each core gets whole heads, so causal work balances
        h, tile = job // n_tiles, job % n_tiles
        t0 = tile * QUERY_TILE
        _prefill_tile(q, kt, v, start, scale, h, t0, min(t0 + QUERY_TILE, T), out)
    return out
