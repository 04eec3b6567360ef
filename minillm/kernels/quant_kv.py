"""Symmetric int8 keys and values: one scale per (token, head) vector.

The KV cache grows with every token of every sequence in flight, so its bytes decide how many
requests fit (chapter 07). Storing K and V as int8 instead of float32 cuts a head's vector of Dh
numbers from 4 Dh bytes to Dh bytes plus one float32 scale:

    scale = max_j |x_j| / 127                    per (token, head): the vector x (Dh,)
    q_j   = round(x_j / scale)   in -127..127    int8; the largest |x_j| lands on +-127
    x_j  ~= q_j * scale                          error at most scale / 2

Symmetric (no zero point) because keys and values are centred near zero, and per vector because
heads and tokens differ in range by orders of magnitude (an outlier channel of one head must not
flatten every other head's grid). Rounding is half to even, as NumPy's ``rint`` and PyTorch's
quantizers do. The all-zero vector gets scale 0 and codes 0.

The engine keeps its cache in float32; chapter 04 measures what this rounding would cost
(``minillm.model.quality.Int8KVCache``) before anyone builds int8 attention kernels.
"""
from __future__ import annotations

import numpy as np

INT8_MAX = 127
SCALE_BYTES = 4  # one float32 scale per (token, head) vector


def quantize_kv_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (..., Dh) float -> q (..., Dh) int8 and scale (...,) float32, with x ~= q * scale[..., None].

    One scale per vector along the last axis, e.g. K of a batch (T, Hkv, Dh) -> scales (T, Hkv).
    """
    x = np.asarray(x)
    if x.ndim < 1 or not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"quantize_kv_int8 needs float vectors (..., Dh), got {x.dtype} of shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("quantize_kv_int8: K/V values must be finite (a NaN or inf has no int8 code)")
    x = x.astype(np.float32, copy=False)
    scale = np.abs(x).max(axis=-1) / np.float32(INT8_MAX)                       # (...,)
    safe = np.where(scale == 0, np.float32(1), scale)[..., None]                 # (..., 1) 0/0 -> 0/1
    q = np.rint(x / safe).astype(np.int8)                                        # (..., Dh) in -127..127
    return q, scale.astype(np.float32)


def dequantize_kv_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """q (..., Dh) int8 and scale (...,) float32 -> (..., Dh) float32 = q * scale."""
    q, scale = np.asarray(q), np.asarray(scale)
    if q.dtype != np.int8 or scale.shape != q.shape[:-1]:
        raise ValueError(f"dequantize_kv_int8 needs int8 codes (..., Dh) and scales (...,), "
                         f"got {q.dtype} {q.shape} and {scale.dtype} {scale.shape}")
    return q.astype(np.float32) * scale.astype(np.float32)[..., None]             # (..., Dh)


def kv_bytes_per_vector(head_dim: int, dtype: str) -> int:
    """Bytes one (token, head) K or V vector of ``head_dim`` numbers occupies: "fp32" or "int8" (+ scale)."""
    sizes = {"fp32": 4 * head_dim, "int8": head_dim + SCALE_BYTES}
    if dtype not in sizes:
        raise ValueError(f"unknown KV dtype {dtype!r}; known: {', '.join(sizes)}")
    return sizes[dtype]
