"""The decoder-only transformer: embedding -> decoder layers -> final norm -> LM head.

One forward serves every chapter. It takes a flat batch - the new tokens of several sequences
packed back to back - plus the ``AttentionMetadata`` that says where each sequence starts, how much
of it is already cached and so each token's position, and a KV cache object (contiguous in
chapters 05/06, paged in chapter 07). Everything else it needs (config, weights, kernel backend,
RoPE tables) is the model's, bundled once in ``Model``. Logits are computed only for the rows the
metadata asks for (by default the last new token of each sequence): the LM head is the largest
matrix of a small model, so a 500-token prompt should not pay for it 500 times.

A decode-sized batch on the numba backend and the paged cache runs its layers in one compiled call
(minillm/kernels/cpu/fused_decode.py) instead of ~7 kernel calls a layer from Python: the same
kernels in the same order, so the same logits bit for bit. ``Model.fused_decode_step`` says when.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np

from minillm.kernels.cpu import fused_decode
from minillm.model.config import ModelConfig
from minillm.model.kv_cache import AttentionMetadata, ContiguousKVCache, KVCache
from minillm.model.layers import (
    PER_OP_FUNCTIONS, LayerContext, LayerWeights, Weight, decoder_layer, embed, linear, no_reduce,
    per_op_functions_in_place,
)


@dataclass
class ModelWeights:
    """Every weight of the model; GGUF weights stay packed (QMatrix), safetensors are fp32."""
    embedding: Weight          # (V, D)
    layers: list[LayerWeights]
    final_norm: np.ndarray     # (D,)
    lm_head: Weight            # (V, D): the embedding itself when the embeddings are tied


def _check_batch(token_ids: np.ndarray, meta: AttentionMetadata, config: ModelConfig) -> None:
    """Bad batches fail here with a message, not deep inside a kernel (Numba does not bounds-check).

    Checked once per forward; the layers' kernels then run on a batch known to fit.
    """
    if token_ids.ndim != 1:
        raise ValueError(f"token_ids must be (N,), got shape {token_ids.shape}")
    if len(token_ids) != meta.num_tokens:
        raise ValueError(f"the batch has {len(token_ids)} tokens but the metadata describes {meta.num_tokens}")
    if token_ids.min() < 0 or token_ids.max() >= config.vocab_size:  # N >= 1: the metadata demands it
        raise ValueError(f"token ids must lie in [0, {config.vocab_size}), got {token_ids.min()}..{token_ids.max()}")
    if meta.max_position >= config.context_length:
        raise ValueError(f"positions must lie in [0, {config.context_length}) (the model's context length), "
                         f"got {meta.positions.min()}..{meta.max_position}")


def _fused_dims(c: ModelConfig) -> tuple[int, int, int, int, int]:
    return c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim, c.intermediate_size  # (D, H, Hkv, Dh, F)


class Model:
    """A loaded model: its config, its weights, the kernel backend it runs on, and ``forward``."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, ops):
        self.config, self.weights, self.ops = config, weights, ops
        self.context = LayerContext.build(config, ops)  # what every layer shares, built once
        self.fused_decode_steps = 0  # forwards whose layers ran fused (see fused_decode_step)
        self._fused_memo = None      # see _fused_layers

    def forward(self, token_ids: np.ndarray, meta: AttentionMetadata, cache: KVCache,
                num_layers: int | None = None) -> np.ndarray:
        """Logits of the rows ``meta.logits_indices`` of a flat batch token_ids (N,) -> (L, V), float32.

        ``num_layers``: run only the first layers, then the final norm and LM head (early exit: a
        self-speculative draft); the K/V those layers write are the ones the full forward writes.
        """
        token_ids = np.asarray(token_ids, dtype=np.int64)   # (N,)
        _check_batch(token_ids, meta, self.config)
        cache.check(meta)
        weights, ops = self.weights, self.ops
        if num_layers is None:
            num_layers = self.config.n_layers
        elif not 1 <= num_layers <= self.config.n_layers:
            raise ValueError(f"num_layers must lie in [1, {self.config.n_layers}], got {num_layers}")
        x = self.embed(token_ids)                             # (N, D)
        fused = self.fused_decode_step(x, meta, cache, num_layers)
        if fused is not None:
            step, runs = fused
            x = step.run(x, runs)                             # (N, D) one compiled call for the layers
            self.fused_decode_steps += 1
        else:
            for layer, layer_weights in enumerate(weights.layers[:num_layers]):
                x = decoder_layer(x, layer_weights, layer, cache, meta, self.context)  # (N, D)
        x = x[meta.logits_indices]                            # (L, D) norm and LM head only where asked
        x = ops.rms_norm(x, weights.final_norm, self.config.rms_eps)  # (L, D)
        return self.lm_head(x)                                # (L, V)

    def fused_decode_step(self, x: np.ndarray, meta: AttentionMetadata, cache: KVCache,
                     num_layers: int) -> tuple[fused_decode.DecodeStep, list] | None:
        """The fused decode step for this batch and its layers' weights, checked, or None where the
        per-op layers must run. The fused layer computes exactly what they compute, so it runs only
        where nothing else would differ: at most ``fused_decode.MAX_ROWS`` rows; every function of
        the per-op forward in place (a learner's decoder layer, seated by the course, runs itself);
        the numba backend's own kernels (not a learner's, a timer's or another backend's); one
        process holding whole layers (a tensor-parallel rank all-reduces between the halves); a
        cache that hands over its paged host arrays (KVCache.paged_host_arrays); every linear weight
        repacked for the SIMD matvec, alike.
        """
        ctx = self.context
        paged = cache.paged_host_arrays()  # (k, v), each (n_layers, num_blocks, block_size, Hkv, Dh), or None
        if (meta.num_tokens > fused_decode.MAX_ROWS or decoder_layer is not PER_OP_FUNCTIONS["decoder_layer"]
                or not per_op_functions_in_place() or ctx.all_reduce is not no_reduce
                or paged is None or not fused_decode.uses_package_kernels(ctx.ops, cache.ops)
                or x.dtype != np.float32 or not x.flags.c_contiguous):
            return None
        runs = self._fused_layers(num_layers)
        if runs is None:
            return None
        c = ctx.config
        k_caches, v_caches = paged
        step = fused_decode.DecodeStep(meta, k_caches, v_caches, num_layers, ctx.cos, ctx.sin, c.rope_style,
                                       c.rms_eps, _fused_dims(c))
        return step, runs

    def _fused_layers(self, num_layers: int) -> list | None:
        """fused_decode.layer_runs of the first ``num_layers`` layers, or None if a layer cannot run
        fused. Made for every layer count asked (an early-exit draft and the full verify alternate)
        and remembered while every weight object is the one they were made from: checking the
        identities is cheaper than checking the weights again every step."""
        weights = [part for w in self.weights.layers
                   for part in (w.attn_norm, w.qkv, w.wo, w.mlp_norm, w.gate_up, w.w_down, w.q_norm, w.k_norm)]
        if self._fused_memo is not None:
            seen, layers, runs = self._fused_memo  # seen keeps its objects alive: no id is reused meanwhile
            if len(seen) == len(weights) and all(map(operator.is_, seen, weights)):
                if layers is not None and num_layers not in runs:
                    runs[num_layers] = fused_decode.layer_runs(layers[:num_layers])
                return None if layers is None else runs[num_layers]
        layers, dims = [], _fused_dims(self.context.config)
        for w in self.weights.layers:
            # unstacked qkv or gate_up (LayerWeights): the per-op path concatenates, the fused one does not
            layer = (fused_decode.layer_weights(w.attn_norm, w.qkv[0], w.wo, w.mlp_norm, w.gate_up[0], w.w_down,
                                                w.q_norm, w.k_norm, dims)
                     if len(w.qkv) == 1 and len(w.gate_up) == 1 else None)
            if layer is None:
                layers = None
                break
            layers.append(layer)
        self._fused_memo = (weights, layers, {})
        return self._fused_layers(num_layers)

    # a rank of a tensor-parallel model holds a slice of the vocabulary: it overrides these two
    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        return embed(token_ids, self.weights.embedding, self.ops)  # (N, D)

    def lm_head(self, x: np.ndarray) -> np.ndarray:
        return linear(x, self.weights.lm_head, self.ops)           # (L, V)

    def new_cache(self, n_slots: int, max_len: int) -> ContiguousKVCache:
        """A contiguous KV cache for ``n_slots`` sequences of up to ``max_len`` tokens each."""
        return ContiguousKVCache(self.config, n_slots, max_len)

    def __repr__(self) -> str:
        c = self.config
        return (f"Model({c.architecture}, {c.n_layers} layers, hidden {c.hidden_size}, "
                f"{c.n_heads}/{c.n_kv_heads} heads, vocab {c.vocab_size})")
