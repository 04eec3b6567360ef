"""Paged attention on the GPU: one thread block per (query, head), keys found through the block table.

The paged KV cache (chapter 07) stores K and V as (num_blocks, block_size, Hkv, Dh): a sequence's
tokens sit in the blocks its block table lists, in order, so token t of sequence b is at

    block_tables[b, t // block_size], offset t % block_size

This kernel runs the steps of the attention kernel of cuda/contiguous_attention.py (the same device
functions) with one change - the address of key s.
Block (i, h) computes query row i, head h: its warps share out the keys (warp w takes keys
w, w + n_warps, ...), its lanes the head dimensions, and each warp keeps the online softmax
(m, l, acc) over its keys; at the end the warps merge through shared memory. Before reading key s
a warp looks up its block in the table - one int32 load, the same for all 32 lanes - and then
reads the key row from that block: still one coalesced read of Dh consecutive floats. No gather:
the keys are never copied into a contiguous buffer.

One kernel serves decode and prefill, as the Numba kernel of cpu/paged_attention.py does: row i knows
its sequence, query_seq[i], and how many keys it sees, query_keys[i] (decode: all of them;
prefill: its position + 1, which makes the chunk causal). Grouped-query attention reads kv head
h // (H // Hkv).

Limits, honestly. One block per (query, head): a decode batch of one sequence with 9 heads is 9
blocks for a GPU of ~100 SMs, and a long context is walked by at most 8 warps of one block; the
query heads of a GQA group each read the shared kv head again (the L2 cache absorbs some of it).
vLLM's paged decode kernel (prefill went to other kernels: xformers, later FlashAttention) differs
where it counts: a block also owns one (sequence, head), but each warp takes a whole KV block at a
time, each small group of its threads one key, loading K in 16-byte vectors from a cache laid out
for exactly that ([num_blocks, Hkv, Dh / x, block_size, x], not our plain rows); it keeps all
scores in shared memory for an ordinary two-pass softmax instead of the online one; its "v2" splits
a long context into partitions of 512 keys, each a block of its own, and merges them with a second
kernel (flash-decoding); and its cache is fp16 / bf16 or fp8, where ours is float32.

`write_kv` stores a batch's new K/V at their slots, one thread block per token.

The host wrappers below also copy the *whole* cache to the device on every call (the host-wrapper
backend's paged cache lives in host memory); the resident model's cache lives on the GPU
(runtime/paged_cache.py: DevicePagedKVCache) and calls `write_kv_gpu` and `paged_attention_gpu`
through kernels/cuda/resident.py, copying nothing.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from minillm.kernels.cuda.contiguous_attention import (
    DIMS_PER_LANE,
    KEYS_PER_WARP,
    MAX_WARPS,
    attend_key,
    attention_scale,
    check_head_dim,
    load_query,
    merge_warps,
)
from minillm.kernels.cuda.setup import WARP, blocks_for, empty_gpu, launch, threads_for, to_gpu, to_host
from minillm.kernels.shapes import check_contiguous_cache, check_write_kv, paged_decode_rows, paged_prefill_rows


# -----------------------------------------------------------------------------------------------
# writing: one block per new token, its threads over the token's Hkv * Dh floats


@cuda.jit
def write_kv_kernel(k_cache, v_cache, k, v, slot_mapping):
    """k_cache, v_cache (num_blocks, block_size, Hkv, Dh) get k[i], v[i] (N, Hkv, Dh) at slot
    slot_mapping[i] (N,) int64, i.e. block slot // block_size, offset slot % block_size. Grid N."""
    i = cuda.blockIdx.x
    block_size, head_dim = k_cache.shape[1], k_cache.shape[3]
    block, offset = slot_mapping[i] // block_size, slot_mapping[i] % block_size
    for e in range(cuda.threadIdx.x, k_cache.shape[2] * head_dim, cuda.blockDim.x):
        h, d = e // head_dim, e % head_dim  # consecutive threads, consecutive floats: coalesced
        k_cache[block, offset, h, d] = k[i, h, d]
        v_cache[block, offset, h, d] = v[i, h, d]


def write_kv_gpu(k_cache, v_cache, k, v, slot_mapping) -> None:
    """Device arrays, the caches written in place (see write_kv_kernel). Checks nothing: see write_kv."""
    launch(write_kv_kernel[len(slot_mapping), threads_for(k.shape[1] * k.shape[2])], k_cache, v_cache, k, v, slot_mapping)


def write_kv(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray, slot_mapping: np.ndarray) -> None:
    """CUDA version of reference.write_kv: k, v (N, Hkv, Dh) into their slots (N,), in place.

    The engine's cache lives in host memory, so the whole cache goes to the device and back for a
    write of N rows; a cache kept on the GPU would call write_kv_gpu and copy nothing.
    """
    slot_mapping = np.asarray(slot_mapping)
    check_write_kv(k_cache, v_cache, k, v, slot_mapping)
    check_contiguous_cache(k_cache, v_cache)
    if not len(slot_mapping):
        return
    k_gpu, v_gpu = to_gpu(k_cache), to_gpu(v_cache)
    write_kv_gpu(k_gpu, v_gpu, to_gpu(k), to_gpu(v), to_gpu(slot_mapping, np.int64))
    to_host(k_gpu, out=k_cache)
    to_host(v_gpu, out=v_cache)



@cuda.jit
def paged_attention_kernel(q, k_cache, v_cache, block_tables, query_seq, query_keys, scale, out):
    """out[i, h] = softmax(scale q[i, h] . K) V over the first query_keys[i] keys of sequence query_seq[i].

    q, out (N, H, Dh); k_cache, v_cache (num_blocks, block_size, Hkv, Dh); block_tables
    (B, max_blocks) int32; query_seq, query_keys (N,) int64. Grid (N, H); blockDim.x = n_warps * 32.
    """
    i, h = cuda.blockIdx.x, cuda.blockIdx.y
    block_size = k_cache.shape[1]
    kv_head = h // (q.shape[1] // k_cache.shape[2])
    table = block_tables[query_seq[i]]  # (max_blocks,) this query's sequence
    lane, warp = cuda.threadIdx.x % WARP, cuda.threadIdx.x // WARP
    n_warps = cuda.blockDim.x // WARP

    q_reg = cuda.local.array(DIMS_PER_LANE, float32)  # (Dh / 32,) this lane's share of q ...
    acc = cuda.local.array(DIMS_PER_LANE, float32)    # (Dh / 32,) ... and of the running output
    load_query(q[i, h], scale, lane, q_reg, acc)
    m = float32(-math.inf)  # running max of the scores seen
    l = float32(0.0)        # running sum of exp(score - m)
    for s in range(warp, query_keys[i], n_warps):
        block, offset = table[s // block_size], s % block_size  # the one difference: key s's address
        m, l = attend_key(q_reg, acc, k_cache[block, offset, kv_head], v_cache[block, offset, kv_head], m, l, lane)
    merge_warps(m, l, acc, lane, out[i, h])


def paged_attention_gpu(q, k_cache, v_cache, block_tables, query_seq, query_keys, max_keys: int, scale: float):
    """Device arrays: q (N, H, Dh); k_cache, v_cache (num_blocks, block_size, Hkv, Dh); block_tables
    (B, max_blocks) int32; query_seq, query_keys (N,) int64. max_keys, a host int, is the largest
    of query_keys: it sizes the launch. -> (N, H, Dh) device array. Checks nothing: see the wrappers.
    """
    N, H, _ = q.shape
    out = empty_gpu(q.shape)  # (N, H, Dh)
    n_warps = min(MAX_WARPS, blocks_for(max_keys, KEYS_PER_WARP))
    launch(paged_attention_kernel[(N, H), n_warps * WARP], q, k_cache, v_cache, block_tables, query_seq, query_keys,
                                                   np.float32(scale), out)
    return out


def _run(q, k_cache, v_cache, block_tables, query_seq, query_keys, scale):
    """Copy to the device, launch, copy back. query_seq, query_keys (N,) host arrays."""
    check_head_dim(q.shape[2])
    out = paged_attention_gpu(to_gpu(q), to_gpu(k_cache), to_gpu(v_cache), to_gpu(block_tables, np.int32),
                              to_gpu(query_seq, np.int64), to_gpu(query_keys, np.int64), int(query_keys.max()),
                              attention_scale(q.shape[2], scale))  # (N, H, Dh) device array
    return to_host(out)


def paged_attention_decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                           context_lens: np.ndarray, scale: float | None = None) -> np.ndarray:
    """CUDA version of reference.paged_attention_decode: q (B, H, Dh) -> (B, H, Dh)."""
    return _run(q, k_cache, v_cache, *paged_decode_rows(q, k_cache, v_cache, block_tables, context_lens), scale)


def paged_attention_prefill(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                            query_starts: np.ndarray, context_lens: np.ndarray,
                            scale: float | None = None) -> np.ndarray:
    """CUDA version of reference.paged_attention_prefill: q (N, H, Dh) -> (N, H, Dh)."""
    rows = paged_prefill_rows(q, k_cache, v_cache, block_tables, query_starts, context_lens)
    return _run(q, k_cache, v_cache, *rows, scale)
