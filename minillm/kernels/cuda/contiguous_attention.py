"""Causal grouped-query attention on the GPU: one thread block per (query, head), online softmax.

Block (t, h) computes the output of query t, head h. Its warps share out the keys (warp w takes
keys w, w + n_warps, ...); within a warp the 32 lanes share out the head dimensions (lane l holds
dims l, l + 32, ...), so each key row is read by one warp as consecutive floats - coalesced.
Per key: a partial dot product in each lane, a warp sum (shuffles), then the online softmax update

    m' = max(m, s);   l' = l * exp(m - m') + exp(s - m');   acc' = acc * exp(m - m') + exp(s - m') * v

which never stores the scores: one pass over K and V, as FlashAttention does. At the end the
warps' (m, l, acc) meet in shared memory and are merged the same way.

Grouped-query attention costs nothing here: query head h simply reads kv head h // (H // Hkv).
Decode is the case T = 1. With 9 heads that is only 9 blocks - a GPU has ~100 SMs - which is why
production kernels (flash-decoding) also split the keys of one head across several blocks.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from minillm.kernels.cuda.basics import warp_sum
from minillm.kernels.cuda.setup import WARP, blocks_for, empty_gpu, launch, to_gpu, to_host
from minillm.kernels.shapes import check_attention, check_attention_decode

MAX_HEAD_DIM = 256
DIMS_PER_LANE = MAX_HEAD_DIM // WARP  # head dims each lane holds in registers
MAX_WARPS = 8  # warps per block
KEYS_PER_WARP = 16  # launch a warp per this many keys (up to MAX_WARPS): no warp sits idle


# -----------------------------------------------------------------------------
# The three steps of one block's work, as device functions: the paged kernel (cuda/paged_attention.py)
# runs the same steps and differs only in where it finds key s.

@cuda.jit(device=True)
def load_query(q_row, scale, lane, q_reg, acc):
    """This lane's share of one query head q_row (Dh,), pre-scaled, into q_reg; acc zeroed."""
    for j in range(DIMS_PER_LANE):
        d = lane + j * WARP
        q_reg[j] = q_row[d] * scale if d < q_row.shape[0] else float32(0.0)
        acc[j] = float32(0.0)


@cuda.jit(device=True)
def attend_key(q_reg, acc, key, value, m, l, lane):
    """One warp takes one key: key, value (Dh,). Updates acc in place, returns the new (m, l)."""
    partial = float32(0.0)
    for j in range(DIMS_PER_LANE):
        d = lane + j * WARP
        if d < key.shape[0]:
            partial += q_reg[j] * key[d]
    score = warp_sum(partial)  # every lane gets q . k_s
    m_new = max(m, score)
    correction = math.exp(m - m_new)  # rescales what was accumulated under the old max
    p = math.exp(score - m_new)
    for j in range(DIMS_PER_LANE):
        d = lane + j * WARP
        if d < key.shape[0]:
            acc[j] = acc[j] * correction + p * value[d]
    return m_new, l * correction + p


@cuda.jit(device=True)
def merge_warps(m, l, acc, lane, out_row):
    """Each warp publishes its (m, l, acc); a warp that saw no key has m = -inf, l = 0. -> out_row (Dh,)."""
    warp, n_warps = cuda.threadIdx.x // WARP, cuda.blockDim.x // WARP
    Dh = out_row.shape[0]
    warp_m = cuda.shared.array(MAX_WARPS, float32)  # (n_warps,)
    warp_l = cuda.shared.array(MAX_WARPS, float32)  # (n_warps,)
    warp_acc = cuda.shared.array((MAX_WARPS, MAX_HEAD_DIM), float32)  # (n_warps, Dh)
    if lane == 0:
        warp_m[warp] = m
        warp_l[warp] = l
    for j in range(DIMS_PER_LANE):
        d = lane + j * WARP
        if d < Dh:
            warp_acc[warp, d] = acc[j]
    cuda.syncthreads()
    m_all = float32(-math.inf)
    for w in range(n_warps):
        m_all = max(m_all, warp_m[w])
    for d in range(cuda.threadIdx.x, Dh, cuda.blockDim.x):
        total_l = float32(0.0)
        total = float32(0.0)
        for w in range(n_warps):
            weight = math.exp(warp_m[w] - m_all)  # 0 for a warp without keys
            total_l += warp_l[w] * weight
            total += warp_acc[w, d] * weight
        out_row[d] = total / total_l


@cuda.jit
def attention_kernel(q, k, v, start, scale, out):
    """q (T, H, Dh); k, v (S, Hkv, Dh) -> out (T, H, Dh). Grid (T, H); blockDim.x = n_warps * 32."""
    t, h = cuda.blockIdx.x, cuda.blockIdx.y
    kv_head = h // (q.shape[1] // k.shape[1])
    n_keys = start + t + 1  # causal: keys 0 .. start + t
    lane, warp = cuda.threadIdx.x % WARP, cuda.threadIdx.x // WARP
    n_warps = cuda.blockDim.x // WARP

    q_reg = cuda.local.array(DIMS_PER_LANE, float32)  # (Dh / 32,) this lane's share of q ...
    acc = cuda.local.array(DIMS_PER_LANE, float32)    # (Dh / 32,) ... and of the running output
    load_query(q[t, h], scale, lane, q_reg, acc)
    m = float32(-math.inf)  # running max of the scores seen
    l = float32(0.0)        # running sum of exp(score - m)
    for s in range(warp, n_keys, n_warps):
        m, l = attend_key(q_reg, acc, k[s, kv_head], v[s, kv_head], m, l, lane)
    merge_warps(m, l, acc, lane, out[t, h])


def attention_gpu(q, k, v, start: int, scale: float):
    """q (T, H, Dh); k, v (S, Hkv, Dh) device arrays -> (T, H, Dh) device array."""
    T, H, _ = q.shape
    out = empty_gpu(q.shape)  # (T, H, Dh)
    n_warps = min(MAX_WARPS, blocks_for(start + T, KEYS_PER_WARP))
    launch(attention_kernel[(T, H), n_warps * WARP], q, k, v, start, np.float32(scale), out)
    return out


def attention_scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def check_head_dim(head_dim: int) -> None:
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"the CUDA attention kernel holds head_dim <= {MAX_HEAD_DIM}, got {head_dim}")


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, scale: float | None = None) -> np.ndarray:
    """Causal GQA: q (T, H, Dh) at positions start.. start+T-1 over k, v (S, Hkv, Dh) -> (T, H, Dh)."""
    check_attention(q, k, v, start)
    check_head_dim(q.shape[2])
    seen = start + q.shape[0]  # keys past the last query's position are never read: don't copy them
    out = attention_gpu(to_gpu(q), to_gpu(k[:seen]), to_gpu(v[:seen]), start, attention_scale(q.shape[2], scale))
    return to_host(out)


def attention_decode(q: np.ndarray, k: np.ndarray, v: np.ndarray, kv_len: int, scale: float | None = None) -> np.ndarray:
    """One query per head, q (H, Dh), over the first kv_len keys of k, v (S, Hkv, Dh) -> (H, Dh).

    The same kernel with T = 1: the query at position kv_len - 1 sees keys 0 .. kv_len - 1.
    """
    check_attention_decode(q, k, v, kv_len)
    check_head_dim(q.shape[1])
    out = attention_gpu(to_gpu(q[None]), to_gpu(k[:kv_len]), to_gpu(v[:kv_len]), kv_len - 1,
                        attention_scale(q.shape[1], scale))
    return to_host(out)[0]
