"""The blocks of a decoder-only transformer (Llama, Qwen3), written with the kernel ops.

Every block works on a flat batch of N tokens (several sequences packed back to back, see
kv_cache.py) and calls the operators of a kernel backend (``ops``, from
``minillm.kernels.registry.get_backend``) for every piece of arithmetic, so the same code runs on
the NumPy reference, the Numba CPU kernels or the GPU. A weight is either an fp32 array
(out, in), as in a Hugging Face checkpoint, or a ``QMatrix`` of packed GGUF blocks that stays
packed: the quantized kernels read it directly.

    decoder_layer:  x -> x + attention(rms_norm(x)) -> h + mlp(rms_norm(h))
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minillm.kernels.quant import QMatrix
from minillm.model.config import ModelConfig
from minillm.model.kv_cache import AttentionMetadata, KVCache

Weight = np.ndarray | QMatrix  # (out, in): fp32, or packed blocks read by the quantized kernels


@dataclass
class LayerWeights:
    """The weights of one decoder layer; D hidden, H/Hkv query/KV heads of Dh, F feed-forward."""
    attn_norm: np.ndarray         # (D,)
    wq: Weight                    # (H * Dh, D)
    wk: Weight                    # (Hkv * Dh, D)
    wv: Weight                    # (Hkv * Dh, D)
    wo: Weight                    # (D, H * Dh)
    mlp_norm: np.ndarray          # (D,)
    w_gate: Weight                # (F, D)
    w_up: Weight                  # (F, D)
    w_down: Weight                # (D, F)
    q_norm: np.ndarray | None = None  # (Dh,) Qwen3's QK-norm; None for Llama
    k_norm: np.ndarray | None = None  # (Dh,)


# -----------------------------------------------------------------------------
# the two ways a weight can be stored

def linear(x: np.ndarray, w: Weight, ops) -> np.ndarray:
    """x (T, in) @ w.T -> (T, out); packed weights go to the quantized kernel, never dequantized whole."""
    if isinstance(w, QMatrix):
        return ops.qlinear(x, w)  # (T, out)
    return ops.linear(x, w)       # (T, out)


def embed(token_ids: np.ndarray, table: Weight, ops) -> np.ndarray:
    """The rows of the embedding table named by token_ids (N,) -> (N, D)."""
    if isinstance(table, QMatrix):
        return ops.qembedding(token_ids, table)  # (N, D) only these rows are dequantized
    return ops.embedding(token_ids, table)       # (N, D)


# -----------------------------------------------------------------------------
# attention and MLP

def self_attention(x: np.ndarray, positions: np.ndarray, weights: LayerWeights, layer: int,
                   cache: KVCache, meta: AttentionMetadata, config: ModelConfig, ops,
                   rope: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Grouped-query causal self-attention of the normed hidden states x (N, D) -> (N, D).

    The new keys and values go into ``cache`` first; the cache then attends each sequence's
    queries over everything it holds for that sequence (its context plus these tokens).
    ``rope`` is the (cos, sin) table pair of ``ops.rope_table``.
    """
    n, n_heads, n_kv_heads, head_dim = x.shape[0], config.n_heads, config.n_kv_heads, config.head_dim
    q = linear(x, weights.wq, ops).reshape(n, n_heads, head_dim)     # (N, H, Dh)
    k = linear(x, weights.wk, ops).reshape(n, n_kv_heads, head_dim)  # (N, Hkv, Dh)
    v = linear(x, weights.wv, ops).reshape(n, n_kv_heads, head_dim)  # (N, Hkv, Dh)
    if weights.q_norm is not None:  # Qwen3: RMSNorm over each head's vector, before RoPE
        q = ops.rms_norm(q.reshape(n * n_heads, head_dim), weights.q_norm, config.rms_eps)
        q = q.reshape(n, n_heads, head_dim)                           # (N, H, Dh)
        k = ops.rms_norm(k.reshape(n * n_kv_heads, head_dim), weights.k_norm, config.rms_eps)
        k = k.reshape(n, n_kv_heads, head_dim)                        # (N, Hkv, Dh)
    cos, sin = rope                                                   # (max_positions, Dh/2) each
    q = ops.rope(q, positions, cos, sin, config.rope_style)           # (N, H, Dh)
    k = ops.rope(k, positions, cos, sin, config.rope_style)           # (N, Hkv, Dh)
    cache.write(layer, k, v, meta)
    out = cache.attend(layer, q, meta, ops)                           # (N, H, Dh)
    return linear(out.reshape(n, n_heads * head_dim), weights.wo, ops)  # (N, D)


def swiglu_mlp(x: np.ndarray, weights: LayerWeights, ops) -> np.ndarray:
    """The gated feed-forward block: down(silu(gate(x)) * up(x)), x (N, D) -> (N, D)."""
    gate = linear(x, weights.w_gate, ops)      # (N, F)
    up = linear(x, weights.w_up, ops)          # (N, F)
    hidden = ops.swiglu(gate, up)              # (N, F)
    return linear(hidden, weights.w_down, ops)  # (N, D)


# -----------------------------------------------------------------------------
# one decoder layer

def decoder_layer(x: np.ndarray, positions: np.ndarray, weights: LayerWeights, layer: int,
                  cache: KVCache, meta: AttentionMetadata, config: ModelConfig, ops,
                  rope: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """One pre-norm decoder layer on the hidden states x (N, D) of a flat batch -> (N, D)."""
    normed = ops.rms_norm(x, weights.attn_norm, config.rms_eps)  # (N, D)
    h = x + self_attention(normed, positions, weights, layer, cache, meta, config, ops, rope)  # (N, D)
    normed = ops.rms_norm(h, weights.mlp_norm, config.rms_eps)   # (N, D)
    return h + swiglu_mlp(normed, weights, ops)                  # (N, D)
