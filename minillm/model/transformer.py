"""The decoder-only transformer: embedding -> decoder layers -> final norm -> LM head.

One forward serves every chapter. It takes a flat batch - the new tokens of several sequences
packed back to back - plus the ``AttentionMetadata`` that says where each sequence starts, how much
of it is already cached and so each token's position, and a KV cache object (contiguous in
chapters 05/06, paged in chapter 07). Everything else it needs (config, weights, kernel backend,
RoPE tables) is the model's, bundled once in ``Model``. Logits are computed only for the rows the
metadata asks for (by default the last new token of each sequence): the LM head is the largest
matrix of a small model, so a 500-token prompt should not pay for it 500 times.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minillm.model.config import ModelConfig
from minillm.model.kv_cache import AttentionMetadata, ContiguousKVCache, KVCache
from minillm.model.layers import LayerContext, LayerWeights, Weight, decoder_layer, embed, linear


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


class Model:
    """A loaded model: its config, its weights, the kernel backend it runs on, and ``forward``."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, ops):
        self.config, self.weights, self.ops = config, weights, ops
        self.context = LayerContext.build(config, ops)  # what every layer shares, built once

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
        for layer, layer_weights in enumerate(weights.layers[:num_layers]):
            x = decoder_layer(x, layer_weights, layer, cache, meta, self.context)  # (N, D)
        x = x[meta.logits_indices]                            # (L, D) norm and LM head only where asked
        x = ops.rms_norm(x, weights.final_norm, self.config.rms_eps)  # (L, D)
        return self.lm_head(x)                                # (L, V)

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
