"""The blocks of a decoder-only transformer (Llama, Qwen3), written with the kernel ops.

Every block works on a flat batch of N tokens (several sequences packed back to back, see
kv_cache.py) and calls the operators of a kernel backend (``ops``, from
``minillm.kernels.registry.get_backend``) for every piece of arithmetic, so the same code runs on
the NumPy reference, the Numba CPU kernels or the GPU. A weight is either an fp32 array
(out, in), as in a Hugging Face checkpoint, or a ``QMatrix`` of packed GGUF blocks that stays
packed: the quantized kernels read it directly.

    decoder_layer:  x -> x + attention(rms_norm(x)) -> h + mlp(rms_norm(h))

What does not change from call to call - the config, the backend, the RoPE tables - travels in one
``LayerContext``, built once per model; what does - the batch and where it lives - travels in the
``AttentionMetadata``, positions included.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from minillm.kernels.quant_formats import QMatrix
from minillm.kernels.cpu.quant_repack import RepackedMatrix, repack
from minillm.model.config import ModelConfig
from minillm.model.kv_cache import AttentionMetadata, KVCache

Weight = np.ndarray | QMatrix  # (out, in): fp32, or packed blocks read by the quantized kernels


@dataclass
class LayerWeights:
    """The weights of one decoder layer; D hidden, H/Hkv query/KV heads of Dh, F feed-forward.

    ``qkv`` and ``gate_up`` are derived: wq, wk, wv (and w_gate, w_up) stacked into one matrix
    when they share a storage type, so that a decode step runs one matvec where it ran three (and
    one where it ran two). Each matvec call costs a kernel launch and a thread barrier besides its
    bytes; stacking removes 90 of the 211 calls of a SmolLM2 step. The separate fields then become
    views of the stacked rows (one copy of the data).
    """
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
    qkv: tuple[Weight, ...] = field(init=False, repr=False)      # ((H + 2 Hkv) * Dh, D), or (wq, wk, wv)
    gate_up: tuple[Weight, ...] = field(init=False, repr=False)  # (2F, D), or (w_gate, w_up)

    def __post_init__(self):
        self.qkv = stack_rows(self.wq, self.wk, self.wv)
        if len(self.qkv) == 1:
            self.wq, self.wk, self.wv = row_views(self.qkv[0], self.wq, self.wk, self.wv)
        self.gate_up = stack_rows(self.w_gate, self.w_up)
        if len(self.gate_up) == 1:
            self.w_gate, self.w_up = row_views(self.gate_up[0], self.w_gate, self.w_up)


def no_reduce(x: np.ndarray) -> np.ndarray:
    """One process holds whole sums: nothing to add up."""
    return x


@dataclass(frozen=True)
class LayerContext:
    """What every layer of one model shares and no call changes: config, backend, RoPE tables,
    and how a rank of a tensor-parallel model sums its partial outputs (minillm/model/sharding.py)."""
    config: ModelConfig
    ops: object                   # a kernel backend (minillm.kernels.registry.Backend)
    cos: np.ndarray               # (context_length, Dh/2) ops.rope_table, computed once
    sin: np.ndarray               # (context_length, Dh/2)
    all_reduce: Callable[[np.ndarray], np.ndarray] = no_reduce  # (N, D) partial sums -> the sum over ranks

    @classmethod
    def build(cls, config: ModelConfig, ops) -> LayerContext:
        cos, sin = ops.rope_table(config.head_dim, config.context_length, config.rope_theta)
        return cls(config, ops, cos, sin)


# -----------------------------------------------------------------------------
# the two ways a weight can be stored

def linear(x: np.ndarray, w: Weight, ops) -> np.ndarray:
    """x (T, in) @ w.T -> (T, out); packed weights go to the quantized kernel, never dequantized whole."""
    if isinstance(w, QMatrix):
        return ops.qlinear(x, w)  # (T, out)
    return ops.linear(x, w)       # (T, out)


def linear_stacked(x: np.ndarray, ws: tuple[Weight, ...], ops) -> np.ndarray:
    """x (T, in) through the stacked weights ws (see LayerWeights) -> (T, out of all of them)."""
    if len(ws) == 1:
        return linear(x, ws[0], ops)                                          # (T, out)
    return np.concatenate([linear(x, w, ops) for w in ws], axis=1)           # (T, out)


def stack_rows(*ws: Weight) -> tuple[Weight, ...]:
    """(one matrix of all the rows of ws,) when they share a storage type and width, else ws unchanged.

    Weights repacked for the SIMD kernels (RepackedMatrix) are stacked, then repacked alike.
    """
    first = ws[0]
    if isinstance(first, QMatrix):
        if any(type(w) is not type(first) or w.qtype != first.qtype or w.shape[1] != first.shape[1]
               or getattr(w, "activations", None) != getattr(first, "activations", None) for w in ws):
            return ws
        rows = sum(w.shape[0] for w in ws)
        stacked = QMatrix(first.qtype, (rows, first.shape[1]), np.concatenate([w.data for w in ws]))
        if isinstance(first, RepackedMatrix):
            return (repack(stacked, first.activations, first.rows_per_group),)
        return (stacked,)
    if any(not isinstance(w, np.ndarray) or w.dtype != first.dtype or w.shape[1:] != first.shape[1:] for w in ws):
        return ws
    return (np.concatenate(ws),)


def row_views(stacked: Weight, *ws: Weight) -> list[Weight]:
    """ws again, as consecutive row ranges of ``stacked`` (views: no second copy of the weights)."""
    views, first = [], 0
    for w in ws:
        last = first + w.shape[0]
        if isinstance(w, QMatrix):
            views.append(QMatrix(w.qtype, w.shape, stacked.data[first:last]))
        else:
            views.append(stacked[first:last])
        first = last
    return views


def embed(token_ids: np.ndarray, table: Weight, ops) -> np.ndarray:
    """The rows of the embedding table named by token_ids (N,) -> (N, D)."""
    if isinstance(table, QMatrix):
        return ops.qembedding(token_ids, table)  # (N, D) only these rows are dequantized
    return ops.embedding(token_ids, table)       # (N, D)


# -----------------------------------------------------------------------------
# attention and MLP

def self_attention(x: np.ndarray, weights: LayerWeights, layer: int, cache: KVCache, meta: AttentionMetadata,
                   ctx: LayerContext) -> np.ndarray:
    """Grouped-query causal self-attention of the normed hidden states x (N, D) -> (N, D).

    The new keys and values go into ``cache`` first; the cache then attends each sequence's
    queries over everything it holds for that sequence (its context plus these tokens).
    """
    config, ops = ctx.config, ctx.ops
    n, n_heads, n_kv_heads, head_dim = x.shape[0], config.n_heads, config.n_kv_heads, config.head_dim
    qkv = linear_stacked(x, weights.qkv, ops).reshape(n, n_heads + 2 * n_kv_heads, head_dim)  # (N, H + 2Hkv, Dh)
    qk, v = qkv[:, :n_heads + n_kv_heads], qkv[:, n_heads + n_kv_heads:]  # (N, H + Hkv, Dh), (N, Hkv, Dh)
    if weights.q_norm is not None:  # Qwen3: RMSNorm over each head's vector, before RoPE
        q = ops.rms_norm(qk[:, :n_heads].reshape(n * n_heads, head_dim), weights.q_norm, config.rms_eps)
        k = ops.rms_norm(qk[:, n_heads:].reshape(n * n_kv_heads, head_dim), weights.k_norm, config.rms_eps)
        qk = np.concatenate([q.reshape(n, n_heads, head_dim), k.reshape(n, n_kv_heads, head_dim)], axis=1)
    # q and k heads rotate alike: one call for both (the CPU kernel rotates in place; use its result)
    qk = ops.rope(qk, meta.positions, ctx.cos, ctx.sin, config.rope_style)  # (N, H + Hkv, Dh)
    q, k = qk[:, :n_heads], qk[:, n_heads:]                                  # (N, H, Dh), (N, Hkv, Dh)
    cache.write(layer, k, v, meta)
    out = cache.attend(layer, q, meta, ops)                                 # (N, H, Dh)
    return linear(out.reshape(n, n_heads * head_dim), weights.wo, ops)      # (N, D)


def swiglu_mlp(x: np.ndarray, weights: LayerWeights, ops) -> np.ndarray:
    """The gated feed-forward block: down(silu(gate(x)) * up(x)), x (N, D) -> (N, D)."""
    gate_up = linear_stacked(x, weights.gate_up, ops)  # (N, 2F)
    f = gate_up.shape[1] // 2
    hidden = ops.swiglu(gate_up[:, :f], gate_up[:, f:])  # (N, F)
    return linear(hidden, weights.w_down, ops)          # (N, D)


# -----------------------------------------------------------------------------
# one decoder layer

def decoder_layer(x: np.ndarray, weights: LayerWeights, layer: int, cache: KVCache, meta: AttentionMetadata,
                  ctx: LayerContext) -> np.ndarray:
    """One pre-norm decoder layer on the hidden states x (N, D) of a flat batch -> (N, D)."""
    eps, ops = ctx.config.rms_eps, ctx.ops
    normed = ops.rms_norm(x, weights.attn_norm, eps)                      # (N, D)
    h = x + ctx.all_reduce(self_attention(normed, weights, layer, cache, meta, ctx))  # (N, D)
    normed = ops.rms_norm(h, weights.mlp_norm, eps)                       # (N, D)
    return h + ctx.all_reduce(swiglu_mlp(normed, weights, ops))           # (N, D)


# The functions of the per-op forward as this module defines them. The fused decode path
# (minillm/kernels/cpu/fused_decode.py) computes what they compute, so the model runs it only while
# every one is in place: code seated instead of one (the course seats a learner's decoder layer
# at minillm.model.transformer.decoder_layer) must run, not be skipped.
PER_OP_FUNCTIONS = {fn.__name__: fn for fn in (decoder_layer, self_attention, swiglu_mlp, linear, linear_stacked)}


def per_op_functions_in_place() -> bool:
    """No function of this module's per-op forward has been replaced."""
    here = globals()
    return all(here[name] is fn for name, fn in PER_OP_FUNCTIONS.items())
