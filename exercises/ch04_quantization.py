"""Chapter 04 exercises: block quantization.

Two tasks on the Q4_1 format - the one every linear weight of SmolLM2 uses - and one on the KV
cache (task 3, below):

    Q4_1 block = 32 weights in 20 bytes:
        bytes 0-1    d, the scale, an IEEE float16 (little-endian)
        bytes 2-3    m, the minimum, an IEEE float16
        bytes 4-19   16 bytes of 4-bit codes q in 0..15:
                     byte j holds weight j in its LOW nibble and weight j + 16 in its HIGH nibble
    weight = q * d + m

A (rows, cols) matrix is stored row by row, each row cut into cols // 32 blocks, so its bytes form
a uint8 array of shape (rows, cols // 32 * 20).

Grade your work with:

    .venv/bin/python -m pytest -m "ch04_q4_1_dequantize or ch04_quant_matvec or ch04_kv_int8" --impl=exercises

Replace each ``raise NotImplementedError(...)`` with your code. Keep the signatures as they are.
"""
from __future__ import annotations

import numpy as np

from minillm.kernels.cpu.quant import QMatrix

# The package objects these stubs mirror (read them after you have tried).
REFERENCE = {
    "dequantize_q4_1": "minillm.kernels.cpu.quant.dequantize_q4_1",
    "qmatvec": "minillm.kernels.cpu.quant.qmatvec",
    "quantize_kv_int8": "minillm.kernels.quant_kv.quantize_kv_int8",
    "dequantize_kv_int8": "minillm.kernels.quant_kv.dequantize_kv_int8",
}

# The functions each task (pytest marker) grades: course.check(marker) runs its tests.
TASKS = {
    "ch04_q4_1_dequantize": ["dequantize_q4_1"],
    "ch04_quant_matvec": ["qmatvec"],
    "ch04_kv_int8": ["quantize_kv_int8", "dequantize_kv_int8"],
}


def dequantize_q4_1(data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Task 1: Q4_1 bytes (rows, cols // 32 * 20) uint8 -> weights (rows, cols) float32.

    Write it in NumPy, whole blocks at a time (no Python loop over blocks):

    1. Reshape the bytes to (n_blocks, 20), n_blocks = rows * cols // 32.
    2. Scales: bytes [:, 0:2] reinterpreted as float16 (``np.ascontiguousarray(...).view(np.float16)``)
       then ``.astype(np.float32)`` -> (n_blocks, 1); the minimum likewise from bytes [:, 2:4].
    3. Codes: the 16 bytes [:, 4:20]; low nibbles ``& 0x0F`` are weights 0..15, high nibbles
       ``>> 4`` are weights 16..31 -> concatenate to (n_blocks, 32).
    4. q * d + m, in float32, reshaped to (rows, cols).

    Example: a block with d = 0.5, m = -1.0 and first byte 0x52 has weight 0 = 2 * 0.5 - 1 = 0.0
    and weight 16 = 5 * 0.5 - 1 = 1.5.
    """
    raise NotImplementedError("chapter 4, task 1")


def qmatvec(x: np.ndarray, qm: QMatrix) -> np.ndarray:
    """Task 2: the fused quantized matvec, y = W @ x, for a Q4_1 QMatrix W (rows, cols).

    x (cols,) float32 -> y (rows,) float32. ``qm.data`` is the packed bytes (rows, cols // 32 * 20).

    Decode is memory-bound: the whole point is to read each packed byte ONCE and never build the
    fp32 matrix. For every row: for every block b, read d and m, then for j in 0..15 take byte j's
    two nibbles and accumulate (q * d + m) * x[32 b + j] (low) and ... * x[32 b + j + 16] (high).
    Accumulate in float32.

    Make it fast with Numba: ``@njit(parallel=True, fastmath=True)`` on a kernel that loops
    ``for r in prange(rows)``. Numba cannot read float16 on the CPU, so decode the two scale bytes
    yourself (lo | hi << 8 -> sign, 5-bit exponent, 10-bit mantissa) or look them up in a
    65536-entry float32 table built once with NumPy. A trick worth having: sum_j (q_j d + m) x_j
    = d * sum_j q_j x_j + m * sum_j x_j, and the block sums of x can be computed once per call.

    The tests compare with x @ W.T (W dequantized by the `gguf` package) at SmolLM2's shapes.
    """
    raise NotImplementedError("chapter 4, task 2")


def quantize_kv_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Task 3: symmetric int8 K/V, one scale per (token, head) vector.

    x (..., Dh) float32 - e.g. the keys of a batch, (T, Hkv, Dh) - -> codes q (..., Dh) int8 and
    scales (...,) float32, one per vector along the LAST axis, such that x ~= q * scale[..., None]:

        scale = max_j |x_j| / 127          (a vector of zeros gets scale 0 and codes 0, not NaN)
        q_j   = round(x_j / scale)         half to even (``np.rint``), so q lies in -127..127

    Symmetric: no zero point (K and V are centred near zero). Whole arrays at a time, no loops.

    Example: x = [0.5, -1.27] -> scale = 0.01, q = [50, -127].
    """
    raise NotImplementedError("chapter 4, task 3")


def dequantize_kv_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Task 3, the way back: codes q (..., Dh) int8 and scales (...,) float32 -> (..., Dh) float32,
    q * scale broadcast over the last axis."""
    raise NotImplementedError("chapter 4, task 3")
