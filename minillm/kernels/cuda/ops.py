"""The transformer's small operators on the GPU: embedding, RMSNorm, softmax, RoPE, SiLU, SwiGLU.

Two shapes of kernel cover them all:

- Row kernels (embedding, rms_norm, softmax): one block per row. The block's threads stride along
  the row together (thread i takes elements i, i + blockDim, ...: coalesced), and when the row
  needs a statistic (a sum of squares, a max) they meet in a block reduction.
- Elementwise kernels (rope, silu, swiglu): one thread per output element (or per rotated pair),
  a 1-D grid of 256-thread blocks. Each reads its inputs once and writes once: pure bandwidth,
  which is why the model fuses SiLU into the multiply by `up` (SwiGLU) instead of running two
  kernels and a round trip through DRAM.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from minillm.kernels.cuda.basics import block_max, block_sum
from minillm.kernels.cuda.setup import MAX_THREADS, blocks_for, empty_gpu, launch, threads_for, to_gpu, to_host
from minillm.kernels.shapes import check_embedding, check_rms_norm, check_rope, check_swiglu

ELEMENTWISE_THREADS = 256

# -----------------------------------------------------------------------------------------------
# embedding: gather rows of the table


@cuda.jit
def embedding_kernel(ids, table, out):
    t = cuda.blockIdx.x  # one block per token
    row = ids[t]
    for i in range(cuda.threadIdx.x, table.shape[1], cuda.blockDim.x):
        out[t, i] = table[row, i]


def embedding_gpu(ids, table):
    """ids (T,) int64, table (V, D) device arrays -> (T, D) device array (ids must be in range)."""
    out = empty_gpu((ids.shape[0], table.shape[1]))  # (T, D)
    launch(embedding_kernel[ids.shape[0], threads_for(table.shape[1])], ids, table, out)
    return out


def embedding(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """ids (T,) int, table (V, D) -> (T, D): the rows the ids name."""
    ids = np.asarray(ids)
    check_embedding(ids, table)
    return to_host(embedding_gpu(to_gpu(ids, np.int64), to_gpu(table)))


# -----------------------------------------------------------------------------------------------
# rms_norm: one block per row - a block sum of squares, then a scaled copy


@cuda.jit
def rms_norm_kernel(x, weight, eps, out):
    scratch = cuda.shared.array(MAX_THREADS, float32)
    row = cuda.blockIdx.x
    D = x.shape[1]
    acc = float32(0.0)
    for i in range(cuda.threadIdx.x, D, cuda.blockDim.x):
        acc += x[row, i] * x[row, i]
    total = block_sum(acc, scratch)  # every thread gets the row's sum of squares
    inv_rms = float32(1.0) / math.sqrt(total / float32(D) + eps)
    for i in range(cuda.threadIdx.x, D, cuda.blockDim.x):  # the row is in L1/L2 by now
        out[row, i] = x[row, i] * inv_rms * weight[i]


def rms_norm_gpu(x, weight, eps: float):
    """x (T, D), weight (D,) device arrays -> (T, D) device array."""
    out = empty_gpu(x.shape)  # (T, D)
    launch(rms_norm_kernel[x.shape[0], threads_for(x.shape[1])], x, weight, np.float32(eps), out)
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x (T, D) -> x / sqrt(mean(x^2) + eps) * weight, per row."""
    check_rms_norm(x, weight)
    rows = x.reshape(-1, x.shape[-1])  # (T, D)
    return to_host(rms_norm_gpu(to_gpu(rows), to_gpu(weight), eps)).reshape(x.shape)


# -----------------------------------------------------------------------------------------------
# softmax: one block per row - a block max, a block sum of exponentials, a scaled write


@cuda.jit
def softmax_kernel(x, out):
    scratch = cuda.shared.array(MAX_THREADS, float32)
    row = cuda.blockIdx.x
    N = x.shape[1]
    m = float32(-math.inf)
    for i in range(cuda.threadIdx.x, N, cuda.blockDim.x):
        m = max(m, x[row, i])
    m = block_max(m, scratch)  # subtracting the max keeps exp() from overflowing
    acc = float32(0.0)
    for i in range(cuda.threadIdx.x, N, cuda.blockDim.x):
        e = math.exp(x[row, i] - m)
        out[row, i] = e
        acc += e
    inv_total = float32(1.0) / block_sum(acc, scratch)
    for i in range(cuda.threadIdx.x, N, cuda.blockDim.x):  # each thread rescales what it wrote
        out[row, i] *= inv_total


def softmax_gpu(x):
    """x (R, N) device array -> (R, N) device array, softmax along each row."""
    out = empty_gpu(x.shape)  # (R, N)
    launch(softmax_kernel[x.shape[0], threads_for(x.shape[1])], x, out)
    return out


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis of x (..., N), numerically stable."""
    rows = x.reshape(-1, x.shape[-1])  # (R, N)
    return to_host(softmax_gpu(to_gpu(rows))).reshape(x.shape)


# -----------------------------------------------------------------------------------------------
# rope: one thread per rotated pair
#
# The style is a kernel argument with the same value in every thread, so the branch on it never
# splits a warp: uniform branches are free, divergent ones cost both sides.

ROPE_HALF, ROPE_PAIRS = 0, 1


@cuda.jit
def rope_kernel(x, positions, cos, sin, style):
    """Rotate x (T, H, Dh) in place: pairs (i, i + Dh/2) for ROPE_HALF, (2i, 2i + 1) for ROPE_PAIRS."""
    T, H, Dh = x.shape
    half = Dh // 2
    n = cuda.grid(1)
    if n >= T * H * half:
        return
    i = n % half  # which pair (and which frequency)
    h = n // half % H
    t = n // (half * H)
    if style == ROPE_PAIRS:
        a, b = 2 * i, 2 * i + 1
    else:
        a, b = i, i + half
    c = cos[positions[t], i]
    s = sin[positions[t], i]
    x1 = x[t, h, a]
    x2 = x[t, h, b]
    x[t, h, a] = x1 * c - x2 * s  # each thread reads, then writes, only its own pair: in place is safe
    x[t, h, b] = x2 * c + x1 * s


def rope_gpu(x, positions, cos, sin, style: str):
    """Rotate the device array x (T, H, Dh) in place (positions (T,) int64, cos/sin (P, Dh/2)); returns x."""
    T, H, Dh = x.shape
    n = T * H * (Dh // 2)
    code = ROPE_PAIRS if style == "pairs" else ROPE_HALF
    launch(rope_kernel[blocks_for(n, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS], x, positions, cos, sin, code)
    return x


def rope(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    """x (T, H, Dh) rotated by the angles of `positions` (T,) -> a new (T, H, Dh) array."""
    positions = np.asarray(positions)
    check_rope(x, positions, cos, sin, style)
    rotated = rope_gpu(to_gpu(x), to_gpu(positions, np.int64), to_gpu(cos), to_gpu(sin), style)
    return to_host(rotated)


# -----------------------------------------------------------------------------------------------
# silu and swiglu: one thread per element


@cuda.jit(device=True)
def _silu(g):
    return g / (float32(1.0) + math.exp(-g))


@cuda.jit
def silu_kernel(x, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = _silu(x[i])


@cuda.jit
def swiglu_kernel(gate, up, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = _silu(gate[i]) * up[i]  # fused: one read of each input, one write


@cuda.jit
def swiglu_rows_kernel(gate, up, out):
    """gate, up (T, F), any strides (column halves of one (T, 2F) array) -> out (T, F)."""
    n = cuda.grid(1)
    F = out.shape[1]
    if n < out.shape[0] * F:
        out[n // F, n % F] = _silu(gate[n // F, n % F]) * up[n // F, n % F]


def silu_gpu(x):
    """x (n,) device array -> (n,) device array silu(x)."""
    out = empty_gpu(x.shape[0])  # (n,)
    launch(silu_kernel[blocks_for(x.shape[0], ELEMENTWISE_THREADS), ELEMENTWISE_THREADS], x, out)
    return out


def swiglu_gpu(gate, up):
    """gate, up (n,) device arrays -> (n,) device array silu(gate) * up."""
    out = empty_gpu(gate.shape[0])  # (n,)
    launch(swiglu_kernel[blocks_for(gate.shape[0], ELEMENTWISE_THREADS), ELEMENTWISE_THREADS], gate, up, out)
    return out


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), elementwise, any shape."""
    return to_host(silu_gpu(to_gpu(x.reshape(-1)))).reshape(x.shape)


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gate, up (T, F) -> (T, F) = silu(gate) * up."""
    check_swiglu(gate, up)
    return to_host(swiglu_gpu(to_gpu(gate.reshape(-1)), to_gpu(up.reshape(-1)))).reshape(gate.shape)
