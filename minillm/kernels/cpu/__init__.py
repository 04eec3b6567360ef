"""The Numba CPU backend: every operator of reference.py, with the same names and signatures.

This module is the backend (registry.py maps "numba" to it); the quantized operators come from
cpu/quant.py and the paged ones from cpu/paged_attention.py.

The kernels live in three files, one idea each: cpu/matmul_ladder.py (the matmul ladder and the decode
matvec), cpu/rows.py (rms_norm, rope, swiglu, softmax: one read and one write per element),
cpu/contiguous_attention.py (decode and tiled prefill attention with the online softmax). This file checks
arguments (a compiled kernel given bad shapes reads out of bounds instead of failing) and
chooses the kernel for the shape:

- serial or parallel: starting the threads of a prange costs a few microseconds, more than a
  decode-sized rms_norm takes, so below PARALLEL_MIN_ELEMENTS the serial driver runs.
- linear, by the number of rows T (measured on a 2-core AMD EPYC (Zen 4), OpenBLAS 0.3.31,
  benchmarks/kernels_cpu.py; one core each, best of many runs, SmolLM2 shapes K, N in {576, 1536}):
    T == 1        matvec: 1.0x OpenBLAS gemv (memory-bound, both read each weight once)
    1 < T < 128   register-tiled matmul (v4 on the (out, in) weights, already "packed"):
                  2-6x faster than OpenBLAS, whose small-M sgemm pays for packing and threading
    T >= 128      OpenBLAS sgemm is about equal at T = 128 and ahead beyond on one core - and
                  still linear uses the register tiles. The reason is threads, not FLOPs: a
                  forward alternates BLAS calls with Numba's parallel kernels, and two thread
                  pools on a few cores wait for each other's spinning workers. On this 2-core
                  machine a 33-token SmolLM2 prefill took 23 s with OpenBLAS threaded inside the
                  forward and 0.9 s with OpenBLAS held to one thread. The engine keeps one pool.
- matmul (b stored (K, N), not yet transposed): OpenBLAS at every shape. Our best rung must
  first pack b transposed (K*N copies, 0.6 ms at 576 x 1536), and with that copy it did not beat
  BLAS on any shape measured.
"""
import math

import numpy as np

from minillm.kernels import shapes
from minillm.kernels.cpu.contiguous_attention import SPLIT_MIN_KEYS, attention_decode_parallel, attention_decode_serial, attention_prefill
from minillm.kernels.cpu.matmul_ladder import (  # noqa: F401  (the ladder is part of this backend's API)
    matmul_nt_parallel,
    matmul_v1_naive,
    matmul_v2_streaming,
    matmul_v3_blocked,
    matmul_v4_parallel,
    matvec,
)
from minillm.kernels.cpu.rows import (
    PARALLEL_MIN_ELEMENTS,
    rms_norm_parallel,
    rms_norm_serial,
    rope_parallel,
    rope_serial,
    silu_flat,
    softmax_parallel,
    softmax_serial,
    swiglu_parallel,
    swiglu_serial,
)
from minillm.kernels.reference import embedding, rope_table  # noqa: F401  (NumPy is already at memory speed)
from minillm.kernels.cpu.paged_attention import paged_attention_decode, paged_attention_prefill, write_kv  # noqa: F401
from minillm.kernels.cpu.quant import qembedding, qlinear  # noqa: F401  (quantized weights: cpu/quant.py)

def _parallel(rows: int, size: int) -> bool:
    """Threads pay off for inputs of many rows and many floats (the row kernels give each core whole rows)."""
    return rows > 1 and size >= PARALLEL_MIN_ELEMENTS

# -----------------------------------------------------------------------------
# linear algebra


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(M, K) @ (K, N) -> (M, N), by OpenBLAS (see the module docstring for why not our ladder)."""
    shapes.check_matmul(a, b)
    shapes.check_float32(a=a, b=b)
    return a @ b  # (M, N)


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (T, in) @ w (out, in).T -> (T, out): matvec for one row, our register tiles for more."""
    shapes.check_linear(x, w)
    shapes.check_float32(x=x, w=w)
    T = x.shape[0]
    if T == 1:
        return matvec(x[0], w)[None, :]  # (1, out) decode: every weight read once
    return matmul_nt_parallel(x, w)  # (T, out) weights (out, in) are already the packed layout


# -----------------------------------------------------------------------------
# row-wise operators


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x (T, D) (or any (..., D)), weight (D,) -> x / rms(x) * weight, fused: two passes over each row."""
    shapes.check_rms_norm(x, weight)
    shapes.check_float32(x=x, weight=weight)
    rows = np.ascontiguousarray(x.reshape(-1, x.shape[-1]))  # (T, D), whole rows for the fixed-order sum
    kernel = rms_norm_parallel if _parallel(rows.shape[0], rows.size) else rms_norm_serial
    out = kernel(rows, weight, np.float32(eps))  # (T, D)
    return out if x.ndim == 2 else out.reshape(x.shape)


def rope(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    """Rotate x (T, H, Dh) in place by the angles of positions (T,); returns x. style "half" or "pairs"."""
    shapes.check_rope_shapes(x, positions, cos, sin, style)
    shapes.check_float32(x=x, cos=cos, sin=sin)
    kernel = rope_parallel if _parallel(x.shape[0], x.size) else rope_serial
    if not kernel(x, positions, cos, sin, style == "half"):  # the kernel checks the positions' range
        shapes.raise_rope_positions(positions, cos.shape[0])
    return x  # (T, H, Dh), the same array


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), elementwise, any shape."""
    shapes.check_float32(x=x)
    return silu_flat(np.ascontiguousarray(x).reshape(-1)).reshape(x.shape)


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up, gate and up (T, F) -> (T, F), fused: one read of each, one write."""
    shapes.check_swiglu(gate, up)
    shapes.check_float32(gate=gate, up=up)
    # gate and up are usually column halves of one (T, 2F) array: the kernels copy row by row
    # (cpu/rows.py says why)
    gate_rows = gate.reshape(-1, gate.shape[-1])  # (T, F)
    up_rows = up.reshape(-1, up.shape[-1])        # (T, F)
    kernel = swiglu_parallel if _parallel(gate_rows.shape[0], gate.size) else swiglu_serial
    return kernel(gate_rows, up_rows).reshape(gate.shape)  # (T, F)


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis of x (..., N), online: two passes over each row instead of three."""
    shapes.check_float32(x=x)
    rows = np.ascontiguousarray(x).reshape(-1, x.shape[-1])  # (R, N)
    kernel = softmax_parallel if _parallel(rows.shape[0], rows.size) else softmax_serial
    return kernel(rows).reshape(x.shape)  # (..., N)


# -----------------------------------------------------------------------------
# attention


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, scale: float | None = None) -> np.ndarray:
    """Causal GQA attention, q (T, H, Dh) at positions start.. over k, v (S, Hkv, Dh) -> (T, H, Dh).

    Tiled with the online softmax (FlashAttention's idea): the T x S scores are never stored.
    """
    shapes.check_attention(q, k, v, start)
    shapes.check_float32(q=q, k=k, v=v)
    scale = 1 / math.sqrt(q.shape[2]) if scale is None else scale
    return attention_prefill(q, k, v, start, np.float32(scale))  # (T, H, Dh)


def attention_decode(q: np.ndarray, k: np.ndarray, v: np.ndarray, kv_len: int, scale: float | None = None) -> np.ndarray:
    """One query per head, q (H, Dh), over the first kv_len keys of k, v (S, Hkv, Dh) -> (H, Dh)."""
    shapes.check_attention_decode(q, k, v, kv_len)
    shapes.check_float32(q=q, k=k, v=v)
    scale = 1 / math.sqrt(q.shape[1]) if scale is None else scale
    split = kv_len >= 2 * SPLIT_MIN_KEYS  # at least two key chunks per kv head: enough jobs for the cores
    kernel = attention_decode_parallel if split else attention_decode_serial
    return kernel(q, k, v, kv_len, np.float32(scale))  # (H, Dh)
