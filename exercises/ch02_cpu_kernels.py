"""Chapter 02 exercises: CPU kernels that move less data.

Write each function below, in NumPy or with Numba (``from numba import njit, prange``). The
specification of every operator is minillm/kernels/reference.py: read it first. Arrays are
float32; your result must match the reference within ~1e-5 (relative). Check your work with

    .venv/bin/python -m pytest tests/test_kernels_cpu.py --impl=exercises \\
        -m "ch02_rmsnorm or ch02_softmax or ch02_rope or ch02_tiled_matmul or ch02_decode_attention"

REFERENCE names the package's own version of each function: read it after you have tried.
"""
import numpy as np

REFERENCE = {
    "rms_norm": "minillm.kernels.cpu.rms_norm",
    "softmax": "minillm.kernels.cpu.softmax",
    "rope": "minillm.kernels.cpu.rope",
    "matmul_v3_blocked": "minillm.kernels.cpu.matmul_v3_blocked",
    "attention_decode": "minillm.kernels.cpu.attention_decode",
}

# The functions each task (pytest marker) grades: course.check(marker) runs its tests.
TASKS = {
    "ch02_rmsnorm": ["rms_norm"],
    "ch02_softmax": ["softmax"],
    "ch02_rope": ["rope"],
    "ch02_tiled_matmul": ["matmul_v3_blocked"],
    "ch02_decode_attention": ["attention_decode"],
}


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x (T, D), weight (D,) -> (T, D): each row divided by sqrt(mean(row**2) + eps), times weight.

    Fuse it: per row, one loop accumulates the sum of squares, a second writes
    x * inv_rms * weight. That reads x twice and writes the output once, where NumPy's
    ``x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * weight`` makes a temporary array at
    every step. Rows are independent: with Numba, ``prange`` over rows uses every core.
    Accumulate in float32 and pass eps as np.float32, or Numba silently computes in float64.
    """
    raise NotImplementedError("chapter 2, task 2")


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis of x (..., N) -> (..., N), numerically stable.

    exp(x - max) / sum(exp(x - max)): subtracting the row max keeps every exp in (0, 1], so
    logits of +-1e4 neither overflow nor give NaN, and -inf logits get probability exactly 0.
    The online form finds max and sum in one pass: keep a running max m and a running sum s;
    when an element (or a chunk) raises the max to m', rescale s by exp(m - m') first. A second
    pass writes exp(x - m) / s.
    """
    raise NotImplementedError("chapter 2, task 3")


def rope(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    """Rotate x (T, H, Dh) by the rotary position embedding; return the rotated array.

    positions (T,) int; cos, sin (max_positions, Dh/2) from ``rope_table``. For token t, head h,
    pair i: with c = cos[positions[t], i], s = sin[positions[t], i] and (a, b) the pair,
    a' = a*c - b*s and b' = b*c + a*s.
    style "half": the pair is (x[..., i], x[..., i + Dh/2]) (Hugging Face's rotate_half).
    style "pairs": the pair is (x[..., 2i], x[..., 2i + 1]) (GGUF llama files).
    Rotating in place (writing into x and returning it) saves an allocation; either is accepted.
    """
    raise NotImplementedError("chapter 2, task 4")


def matmul_v3_blocked(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(M, K) @ (K, N) -> (M, N), cache-blocked: no ``@``, ``np.dot`` or ``np.matmul`` allowed.

    Loop over tiles so that the data a tile needs stays in cache while it is reused: e.g. for a
    block of columns of b small enough for L2, run every row of a past it; inside, use the i-k-j
    order (c[i, j0:j1] += a[i, k] * b[k, j0:j1]) so the innermost loop walks contiguous memory.
    Handle sizes that are not multiples of your tile (1, odd, prime). With Numba, compare your
    GFLOP/s against the chapter's ladder.
    """
    raise NotImplementedError("chapter 2, task 1")


def attention_decode(q: np.ndarray, k: np.ndarray, v: np.ndarray, kv_len: int, scale: float | None = None) -> np.ndarray:
    """One new query per head over the first kv_len cached keys: q (H, Dh); k, v (S, Hkv, Dh) -> (H, Dh).

    For query head h, use kv head h // (H // Hkv) (grouped-query attention: several query heads
    share one key/value head). Index it; do not np.repeat K and V. scores_s = q_h . k_s * scale
    for s < kv_len (scale defaults to 1/sqrt(Dh)); weights = softmax(scores); out_h =
    sum_s weights_s v_s. Keys at and beyond kv_len are stale buffer space: ignore them.
    """
    raise NotImplementedError("chapter 2, task 5")
