"""The specification: every operator of a decoder-only transformer, in plain NumPy.

Written to be read, not to be fast. Each function is the definition the fast kernels (Numba CPU
in cpu/__init__.py, Numba CUDA in cuda/__init__.py) are tested against, and the "reference" backend of the
registry runs a whole model on them: this module holds every operator of registry.OPS, the
quantized and paged ones included, under the names the other backends use. Arrays are float32; weights are stored (out, in) as in
Hugging Face and GGUF files. Shapes use T tokens, D hidden size, F feed-forward size, H query
heads, Hkv key/value heads, Dh head size, S cached keys.
"""
import math

import numpy as np

from minillm.kernels import shapes
from minillm.kernels.quant_formats import QMatrix, dequantize_reference

# -----------------------------------------------------------------------------
# linear algebra


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(M, K) @ (K, N) -> (M, N): c[i, j] = sum over k of a[i, k] * b[k, j]."""
    shapes.check_matmul(a, b)
    return a @ b  # (M, N)


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """A layer without bias: x (T, in), weight w (out, in) -> x @ w.T (T, out)."""
    shapes.check_linear(x, w)
    return x @ w.T  # (T, out)


def embedding(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """The rows of table (V, D) named by the token ids (T,) -> (T, D)."""
    shapes.check_embedding(ids, table)
    return table[ids]  # (T, D)


# -----------------------------------------------------------------------------
# normalisation


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Divide each row by its root-mean-square, then scale by weight: x (T, D), weight (D,) -> (T, D).

    No mean is subtracted (that is LayerNorm); eps keeps an all-zero row finite.
    """
    shapes.check_rms_norm(x, weight)
    mean_square = np.mean(x * x, axis=-1, keepdims=True)  # (T, 1)
    return x / np.sqrt(mean_square + eps) * weight         # (T, D)


# -----------------------------------------------------------------------------
# rotary position embedding


def rope_table(head_dim: int, max_positions: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every rotation angle, each (max_positions, head_dim // 2) float32.

    Pair i of a head turns by angle position * theta ** (-2i / head_dim): the first pairs spin
    fast (fine position), the last ones slowly (coarse position). Angles are computed in float64
    and rounded once; Hugging Face computes them in float32, which differs by about
    position * 6e-8 radians.
    """
    if head_dim % 2:
        raise ValueError(f"rope needs an even head_dim, got {head_dim}")
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # (Dh/2,)
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)         # (P, Dh/2)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)     # (P, Dh/2) each


def rope(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    """Rotate each pair of coordinates of every head by its angle: x (T, H, Dh) -> new (T, H, Dh).

    style "half" (Hugging Face): pair i is (x[i], x[i + Dh/2]), the two halves of the head.
    style "pairs" (GGUF llama): pair i is (x[2i], x[2i + 1]), adjacent coordinates.
    The two agree after permuting each head's rows: pairs-row 2i + t holds half-row i + t*Dh/2
    (that is how llama.cpp's converter stores Q and K weights).
    """
    shapes.check_rope(x, positions, cos, sin, style)
    c = cos[positions][:, None, :]  # (T, 1, Dh/2) broadcast over heads
    s = sin[positions][:, None, :]  # (T, 1, Dh/2)
    if style == "half":
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]                                    # (T, H, Dh/2) each
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)       # (T, H, Dh)
    x1, x2 = x[..., 0::2], x[..., 1::2]                                          # (T, H, Dh/2) each
    return np.stack([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(x.shape)  # (T, H, Dh) interleaved


# -----------------------------------------------------------------------------
# activations


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), elementwise."""
    with np.errstate(over="ignore"):  # exp(-x) overflows to inf for x < -88: x / inf = -0 is the limit
        return x / (1 + np.exp(-x))   # same shape as x


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """The gated unit of the MLP: silu(gate) * up, gate and up (T, F) -> (T, F)."""
    shapes.check_swiglu(gate, up)
    return silu(gate) * up  # (T, F)


def softmax(x: np.ndarray) -> np.ndarray:
    """exp(x) / sum(exp(x)) over the last axis, (..., N) -> (..., N).

    Subtracting the row maximum first changes nothing mathematically (the factor exp(-max)
    cancels) and keeps every exp in (0, 1]: no overflow, whatever the logits.
    """
    shifted = x - np.max(x, axis=-1, keepdims=True)  # (..., N) all <= 0
    e = np.exp(shifted)                              # (..., N) in (0, 1]
    return e / np.sum(e, axis=-1, keepdims=True)     # (..., N) rows sum to 1


# -----------------------------------------------------------------------------
# attention


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, scale: float | None = None) -> np.ndarray:
    """Causal grouped-query attention of T new queries over a key/value buffer.

    q (T, H, Dh); k, v (S, Hkv, Dh) with S >= start + T. Query t sits at position start + t and
    sees keys 0 .. start + t (inclusive); keys past start + T are ignored. Query head h reads
    kv head h // (H // Hkv), as Hugging Face's repeat_kv lays them out. -> (T, H, Dh)
    """
    shapes.check_attention(q, k, v, start)
    T, H, Dh = q.shape
    group = H // k.shape[1]                        # query heads per kv head
    scale = 1 / math.sqrt(Dh) if scale is None else scale
    L = start + T                                  # keys the last query sees
    k = np.repeat(k[:L], group, axis=1)            # (L, H, Dh) kv head j serves heads j*group ..
    v = np.repeat(v[:L], group, axis=1)            # (L, H, Dh)
    scores = np.einsum("thd,shd->hts", q, k) * scale                 # (H, T, L)
    visible = np.arange(L)[None, :] <= start + np.arange(T)[:, None]  # (T, L) causal mask
    scores = np.where(visible, scores, -np.inf)                      # (H, T, L)
    weights = softmax(scores)                                        # (H, T, L)
    return np.einsum("hts,shd->thd", weights, v).astype(np.float32)  # (T, H, Dh)


def attention_decode(q: np.ndarray, k: np.ndarray, v: np.ndarray, kv_len: int, scale: float | None = None) -> np.ndarray:
    """One new query per head attending the first kv_len cached keys: q (H, Dh); k, v (S, Hkv, Dh) -> (H, Dh).

    The decode step of generation: the query is the newest token, so every cached key is in its
    past and no mask is needed.
    """
    shapes.check_attention_decode(q, k, v, kv_len)
    H, Dh = q.shape
    group = H // k.shape[1]                        # query heads per kv head
    scale = 1 / math.sqrt(Dh) if scale is None else scale
    k = np.repeat(k[:kv_len], group, axis=1)       # (S, H, Dh)
    v = np.repeat(v[:kv_len], group, axis=1)       # (S, H, Dh)
    scores = np.einsum("hd,shd->hs", q, k) * scale  # (H, S)
    weights = softmax(scores)                       # (H, S)
    return np.einsum("hs,shd->hd", weights, v).astype(np.float32)  # (H, Dh)


# -----------------------------------------------------------------------------
# paged attention: gather a sequence's blocks, then attend as if the cache were contiguous


def write_kv(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray, slot_mapping: np.ndarray) -> None:
    """Store new keys and values k, v (N, Hkv, Dh) in place, row i at slot slot_mapping[i].

    Slot s is offset s % block_size of block s // block_size; the caches are (num_blocks,
    block_size, Hkv, Dh). Nothing is returned: the cache is the backend's storage.
    """
    slot_mapping = np.asarray(slot_mapping)
    shapes.check_write_kv(k_cache, v_cache, k, v, slot_mapping)
    block_size, slots = k_cache.shape[1], slot_mapping.astype(np.int64)
    blocks, offsets = slots // block_size, slot_mapping % block_size  # (N,) each
    k_cache[blocks, offsets] = k  # (N, Hkv, Dh)
    v_cache[blocks, offsets] = v  # (N, Hkv, Dh)


def gather_kv(k_cache: np.ndarray, v_cache: np.ndarray, block_table: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The first seq_len keys and values of one sequence, in token order -> k, v (seq_len, Hkv, Dh)."""
    num_blocks, block_size, n_kv_heads, head_dim = k_cache.shape
    blocks = block_table[: -(-seq_len // block_size)]                                  # (n_blocks,)
    k = k_cache[blocks].reshape(-1, n_kv_heads, head_dim)[:seq_len]  # (seq_len, Hkv, Dh) blocks laid end to end
    v = v_cache[blocks].reshape(-1, n_kv_heads, head_dim)[:seq_len]  # (seq_len, Hkv, Dh)
    return k, v


def paged_attention_decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                                     block_tables: np.ndarray, context_lens: np.ndarray,
                                     scale: float | None = None) -> np.ndarray:
    """One query per sequence, q (B, H, Dh), over the first context_lens[b] keys of its blocks -> (B, H, Dh)."""
    context_lens = np.asarray(context_lens, dtype=np.int64)  # (B,) keys each query sees, its own included
    block_tables = np.asarray(block_tables)                  # (B, max_blocks)
    shapes.check_paged_attention(q, k_cache, v_cache, block_tables, context_lens)
    if len(q) != len(context_lens):
        raise ValueError(f"paged decode: {len(q)} queries for {len(context_lens)} sequences")
    out = np.empty_like(q)  # (B, H, Dh)
    for b, n in enumerate(context_lens):
        k, v = gather_kv(k_cache, v_cache, block_tables[b], n)        # (n, Hkv, Dh) each
        out[b] = attention_decode(q[b], k, v, n, scale)     # (H, Dh)
    return out


def paged_attention_prefill(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                                      block_tables: np.ndarray, query_starts: np.ndarray,
                                      context_lens: np.ndarray, scale: float | None = None) -> np.ndarray:
    """New queries q (N, H, Dh) of B sequences, each chunk on top of context_lens[b] cached keys -> (N, H, Dh).

    Sequence b owns rows query_starts[b]:query_starts[b+1]; its query t sits at position
    context_lens[b] + t and sees keys 0 .. context_lens[b] + t. The chunk's own K/V must already
    be written (write_kv) - the cache holds context_lens[b] + chunk length keys.
    """
    query_starts = np.asarray(query_starts, dtype=np.int64)  # (B+1,)
    context_lens = np.asarray(context_lens, dtype=np.int64)  # (B,) keys cached before the chunk
    block_tables = np.asarray(block_tables)                  # (B, max_blocks)
    shapes.check_query_starts(q, query_starts, context_lens)
    seq_lens = context_lens + np.diff(query_starts)          # (B,) keys after the chunk
    shapes.check_paged_attention(q, k_cache, v_cache, block_tables, seq_lens)
    out = np.empty_like(q)  # (N, H, Dh)
    for b, n in enumerate(seq_lens):
        rows = slice(query_starts[b], query_starts[b + 1])
        k, v = gather_kv(k_cache, v_cache, block_tables[b], n)                     # (n, Hkv, Dh) each
        out[rows] = attention(q[rows], k, v, context_lens[b], scale)      # (T, H, Dh)
    return out


# -----------------------------------------------------------------------------
# quantized weights: dequantize by the format's definition (quant_formats.py), then as above


def qlinear(x: np.ndarray, qm: QMatrix) -> np.ndarray:
    """x (T, cols) -> (T, rows) = x @ W.T with W = the packed blocks of qm, dequantized first."""
    return np.asarray(x, dtype=np.float32) @ dequantize_reference(qm).T  # (T, rows)


def qembedding(ids: np.ndarray, qm: QMatrix) -> np.ndarray:
    """The rows of a quantized table named by ids (T,) -> (T, cols); only those rows are dequantized."""
    shapes.check_embedding(ids, qm)
    rows = QMatrix(qm.qtype, (ids.shape[0], qm.shape[1]), qm.data[ids])  # (T, packed bytes) their blocks
    return dequantize_reference(rows)  # (T, cols)
