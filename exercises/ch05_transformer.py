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
    """One pre-norm decoder layer (Llama; Qwen3 with QK-norm) on a flat batch: x (N, D) -> (N, D).

    Inputs:
      x        (N, D) float32 hidden states of N new tokens of meta.num_seqs sequences, packed
               back to back; meta.positions (N,) are their positions in their sequences
      weights  this layer's LayerWeights (minillm/model/layers.py: the norms, wq wk wv wo,
               w_gate w_up w_down - an ndarray or a packed QMatrix each - and q_norm/k_norm or None)
      layer    its index: the cache keeps K/V per layer
      cache    a KVCache: ``cache.write(layer, k, v, meta)`` stores this batch's keys and values,
               ``cache.attend(layer, q, meta, ops)`` -> (N, H, Dh) causal grouped-query attention of
               each sequence's queries over everything it has cached (this batch's keys included)
      ctx      what every layer shares: ctx.config (H, Hkv, Dh, rms_eps, rope_style, ...),
               ctx.ops (a kernel backend: rms_norm, rope, swiglu, linear for an ndarray weight,
               qlinear for a QMatrix) and the RoPE tables ctx.cos, ctx.sin
    Output: (N, D) float32, the layer's output - what Hugging Face's LlamaDecoderLayer (Qwen3's)
    computes for the same tokens: the attention block and the SwiGLU MLP, each on the RMS-normed
    input and added back to it.
    Invariants: x is not modified in place (the caller may still need it); the keys written are
    rotated by RoPE at their positions, the values are not; q and k of Qwen3 are RMS-normed per
    head before RoPE.
    Edge cases: N = 1 (a decode step); several sequences in one batch; a QMatrix or an ndarray
    for any weight.

    Test: .venv/bin/python -m pytest -m ch05_decoder_layer --impl=exercises   (against transformers)
    """
    raise NotImplementedError("chapter 5, task 2")
