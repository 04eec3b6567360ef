"""Chapter 05 exercises: the transformer.

Run the tests against your code with

    pytest -m "ch05_rope_convention or ch05_decoder_layer" --impl=exercises

Task 1 (ch05_rope_convention): undo llama.cpp's reordering of the Q/K weight rows.
Task 2 (ch05_decoder_layer): one decoder layer, from the kernel ops, checked against transformers.
"""
from __future__ import annotations

import numpy as np

from minillm.kernels.cpu.quant import QMatrix
from minillm.model.kv_cache import AttentionMetadata, KVCache
from minillm.model.layers import LayerContext, LayerWeights

REFERENCE = {
    "unpermute_qk_rows": "minillm.model.loader.unpermute_qk_rows",
    "decoder_layer": "minillm.model.layers.decoder_layer",
}

# The functions each task (pytest marker) grades: course.check(marker) runs its tests.
TASKS = {
    "ch05_rope_convention": ["unpermute_qk_rows"],
    "ch05_decoder_layer": ["decoder_layer"],
}


def unpermute_qk_rows(w: np.ndarray | QMatrix, n_heads: int) -> np.ndarray | QMatrix:
    """Rows of a GGUF llama attn_q/attn_k weight (out, in) back in Hugging Face order.

    Hugging Face's RoPE rotates the pairs (i, i + d/2) of each head of dim d ("rotate half");
    llama.cpp rotates adjacent pairs (2i, 2i + 1). So that both compute the same thing, the
    converter reorders the rows of attn_q and attn_k inside every head: the file's row 2i + t
    (t in {0, 1}) holds the original row i + t * d/2.

    Return w with the original (HF) row order. Steps:
    - d = rows // n_heads; refuse rows that do not split into n_heads heads of an even d
      (ValueError).
    - Build the order in which to read the file's rows: for HF row (head h, half t, index i), read
      file row (h, i, t). np.arange(rows).reshape(...).transpose(...).reshape(rows) does it.
    - An ndarray: gather its rows in that order (w[order]).
    - A QMatrix: a row of packed blocks is a whole row of weights, so move the packed rows the same
      way - QMatrix(w.qtype, w.shape, w.data[order]) - with no dequantization.
    For K weights the caller passes the number of KV heads.
    """
    raise NotImplementedError("chapter 5, task 1")


def decoder_layer(x: np.ndarray, weights: LayerWeights, layer: int, cache: KVCache, meta: AttentionMetadata,
                  ctx: LayerContext) -> np.ndarray:
    """One pre-norm decoder layer on the hidden states x (N, D) of a flat batch -> (N, D).

    x holds N new tokens of meta.num_seqs sequences packed back to back; meta.positions (N,) are
    their positions. ``ctx`` holds what every layer of the model shares: ctx.config, ctx.ops (a
    kernel backend: ops.linear, ops.rms_norm, ops.rope, ops.swiglu, ..., plus ops.qlinear for a
    QMatrix weight) and ctx.cos, ctx.sin (the RoPE tables of ops.rope_table).
    With H = config.n_heads, Hkv = config.n_kv_heads, Dh = config.head_dim, eps = config.rms_eps:

    attention half
      1. h = rms_norm(x, weights.attn_norm)                                      (N, D)
      2. q, k, v = h @ wq.T, h @ wk.T, h @ wv.T, reshaped to (N, H, Dh), (N, Hkv, Dh), (N, Hkv, Dh)
         (a weight may be a QMatrix: use ops.qlinear for it, ops.linear for an ndarray)
      3. Qwen3 only (weights.q_norm is not None): RMSNorm over each head's Dh values of q and k,
         with weights.q_norm / weights.k_norm - reshape to (N * heads, Dh) for ops.rms_norm
      4. rotate q and k: ops.rope(..., meta.positions, ctx.cos, ctx.sin, config.rope_style)
      5. cache.write(layer, k, v, meta), then out = cache.attend(layer, q, meta, ops)  (N, H, Dh)
         - the cache does the causal, grouped-query attention over each sequence's past
      6. x = x + out.reshape(N, H * Dh) @ wo.T                                   (N, D)
    MLP half
      7. h = rms_norm(x, weights.mlp_norm)
      8. x = x + (silu(h @ w_gate.T) * (h @ w_up.T)) @ w_down.T     (ops.swiglu does silu(g) * u)
    Return x. Do not modify the input x in place (the caller may still need it).
    """
    raise NotImplementedError("chapter 5, task 2")
