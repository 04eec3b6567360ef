"""Argument checks shared by every kernel backend: a bad call fails at once, naming the problem.

A compiled kernel handed mismatched shapes does not fail politely: it reads past the end of an
array and returns garbage (or crashes). So every backend checks its arguments here, in Python,
before any compiled code runs. Each check returns nothing and raises ValueError on bad input.
"""
import numpy as np

ROPE_STYLES = ("half", "pairs")


FLOAT32 = np.dtype(np.float32)


def check_float32(**arrays: np.ndarray) -> None:
    """The compiled kernels are fp32 only (one specialisation each, no silent float64 copies)."""
    for name, a in arrays.items():
        if a.dtype is not FLOAT32 and a.dtype != FLOAT32:  # identity first: `!=` converts, 5x slower
            raise ValueError(f"{name} must be float32, got {a.dtype}")


def check_matmul(a: np.ndarray, b: np.ndarray) -> None:
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"matmul needs a (M, K) and b (K, N), got shapes {a.shape} and {b.shape}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul inner sizes differ: a {a.shape} has K={a.shape[1]}, b {b.shape} has K={b.shape[0]}")


def check_linear(x: np.ndarray, w: np.ndarray) -> None:
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"linear needs x (T, in) and w (out, in), got shapes {x.shape} and {w.shape}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"linear: x {x.shape} has in={x.shape[1]} but w {w.shape} has in={w.shape[1]}")


def check_embedding(ids: np.ndarray, table: np.ndarray) -> None:
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"embedding ids must be a 1-D integer array, got {ids.dtype} of shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
        raise ValueError(f"embedding ids must lie in [0, {table.shape[0]}), got [{ids.min()}, {ids.max()}]")


def check_rms_norm(x: np.ndarray, weight: np.ndarray) -> None:
    if weight.ndim != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: x {x.shape} and weight {weight.shape} disagree on the last size")


def check_rope_shapes(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> None:
    """Everything check_rope checks but the positions' range (a kernel that checks it itself skips it)."""
    if style not in ROPE_STYLES:
        raise ValueError(f"rope style must be one of {ROPE_STYLES}, got {style!r}")
    if x.ndim != 3:
        raise ValueError(f"rope needs x (T, H, Dh), got shape {x.shape}")
    if positions.shape != (x.shape[0],):
        raise ValueError(f"rope needs one position per row of x {x.shape}, got positions {positions.shape}")
    if cos.shape != sin.shape or cos.ndim != 2 or 2 * cos.shape[1] != x.shape[2]:
        raise ValueError(f"rope tables {cos.shape}/{sin.shape} do not fit head_dim {x.shape[2]}")


def check_rope(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> None:
    check_rope_shapes(x, positions, cos, sin, style)
    if positions.size and (positions.min() < 0 or positions.max() >= cos.shape[0]):
        raise_rope_positions(positions, cos.shape[0])


def raise_rope_positions(positions: np.ndarray, n_positions: int) -> None:
    raise ValueError(f"rope positions must lie in [0, {n_positions}), got [{positions.min()}, {positions.max()}]")


def check_swiglu(gate: np.ndarray, up: np.ndarray) -> None:
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {gate.shape} and up {up.shape} differ")


def _check_kv(q_heads: int, head_dim: int, k: np.ndarray, v: np.ndarray) -> None:
    if k.ndim != 3 or k.shape != v.shape:
        raise ValueError(f"attention needs k and v of one shape (S, Hkv, Dh), got {k.shape} and {v.shape}")
    if k.shape[2] != head_dim:
        raise ValueError(f"attention: queries have head_dim {head_dim}, keys {k.shape[2]}")
    if k.shape[1] == 0 or q_heads % k.shape[1]:
        raise ValueError(f"attention: {q_heads} query heads are not a multiple of {k.shape[1]} kv heads")


def check_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> None:
    if q.ndim != 3:
        raise ValueError(f"attention needs q (T, H, Dh), got shape {q.shape}")
    _check_kv(q.shape[1], q.shape[2], k, v)
    if start < 0 or k.shape[0] < start + q.shape[0]:
        raise ValueError(f"attention: start {start} + {q.shape[0]} queries needs that many keys, k has {k.shape[0]}")


def check_attention_decode(q: np.ndarray, k: np.ndarray, v: np.ndarray, kv_len: int) -> None:
    if q.ndim != 2:
        raise ValueError(f"attention_decode needs q (H, Dh), got shape {q.shape}")
    _check_kv(q.shape[0], q.shape[1], k, v)
    if not 0 < kv_len <= k.shape[0]:
        raise ValueError(f"attention_decode: kv_len {kv_len} must lie in [1, {k.shape[0]}] (the keys held)")
