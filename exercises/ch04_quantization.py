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
    """Task 1: Q4_1 bytes -> the float32 weights they encode.

    Inputs: ``data`` uint8 (rows, cols // 32 * 20), a matrix in the Q4_1 layout of the module
    docstring (each row cut into blocks of 32 weights, 20 bytes a block); ``rows``, ``cols``
    its shape, with cols a multiple of 32.
    Output: float32 (rows, cols); weight j of a block is q_j * d + m, computed in float32, with
    d and m the block's float16 scale and minimum and q_j its 4-bit code.
    Invariants: element for element equal to the ``gguf`` package's dequantization (the test's
    oracle), for any rows >= 1 and any multiple of 32 for cols; ``data`` is not modified.
    Edge cases: a block with d = 0 decodes to m everywhere; rows = 1.
    Whole arrays at a time: a Python loop over SmolLM2's 1.4 million blocks would take minutes.

    Test: .venv/bin/python -m pytest -m ch04_q4_1_dequantize --impl=exercises
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
