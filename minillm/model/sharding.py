"""Tensor parallelism's split of the weights (Megatron-LM): which rows or columns each rank holds.

A linear pair splits with one all-reduce and no other communication:

    column-parallel  W_in (F, D) by rows:     rank r computes its own F_r outputs, h_r = x @ W_in[r].T
    elementwise      silu, the gate's product: each rank on its own columns of h, nothing to exchange
    row-parallel     W_out (D, F) by columns: rank r's partial y_r = h_r @ W_out[:, r].T is (N, D)
    all-reduce       y = sum_r y_r            every rank gets the full output

In a decoder layer Q/K/V and gate/up are column-parallel, O and down row-parallel: two
all-reduces per layer. Attention splits by heads - a KV head travels with its query heads (one
GQA group), so each rank attends with its own heads over its own KV cache, never needing
another's keys. The embedding and LM head split by vocabulary: a rank looks up only the tokens in
its rows (the others' rows give zeros, an all-reduce sums them), and scores only its slice of the
vocabulary (the logits are gathered, see minillm/runtime/tensor_parallel.py).

Splits are contiguous and as even as possible: SmolLM2's 3 KV heads on 2 ranks are 2 + 1. The
larger rank then sets the pace - the other waits for it at every all-reduce. A KV head cannot be
split, so more ranks than KV heads are refused (vLLM replicates KV heads there instead). Split
inputs of quantized weights are cut in whole 32-value blocks; nothing is dequantized.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minillm.kernels.quant_formats import BLOCK_BYTES, BLOCK_SIZE, QMatrix
from minillm.kernels.registry import get_backend
from minillm.model.config import ModelConfig
from minillm.model.layers import Weight, embed, linear
from minillm.model.loader import check_load_options, read_weights, repack_linear_weights
from minillm.model.transformer import Model, ModelWeights


def shard_range(n: int, world_size: int, rank: int, unit: int = 1) -> tuple[int, int]:
    """[start, stop) of rank's contiguous share of n items, in whole units, as even as possible
    (the first ranks take one unit more when the units do not divide evenly)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, world_size) with world_size >= 1, got rank {rank}, "
                         f"world_size {world_size}")
    if n % unit:
        raise ValueError(f"{n} items do not split into whole units of {unit}")
    units = n // unit
    if units < world_size:
        raise ValueError(f"{units} units of {unit} cannot be shared by {world_size} ranks")
    base, extra = divmod(units, world_size)
    start = rank * base + min(rank, extra)
    return start * unit, (start + base + (rank < extra)) * unit


def column_row_linear(x: np.ndarray, w_in: np.ndarray, w_out: np.ndarray, world_size: int,
                      all_reduce: Callable[[list[np.ndarray]], np.ndarray],
                      activation: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """activation(x @ w_in.T) @ w_out.T computed the tensor-parallel way, every rank in turn here.

    x (N, D), w_in (F, D) column-parallel, w_out (D, F) row-parallel; rank r holds the F rows
    ``shard_range(F, world_size, r)``. ``all_reduce(partials)`` gets each rank's partial output
    (N, D), in rank order, and returns their sum - one call for the whole pair.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    partials = []
    for rank in range(world_size):
        start, stop = shard_range(w_in.shape[0], world_size, rank)
        h = activation(x @ w_in[start:stop].T)        # (N, F_r): elementwise, needs no other rank
        partials.append(h @ w_out[:, start:stop].T)   # (N, D) a partial sum of the output
    return all_reduce(partials)                       # (N, D)


# -----------------------------------------------------------------------------
# one rank's share of the model

@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``world_size``: its [start, stop) of KV heads, query heads, F and vocabulary."""
    rank: int
    world_size: int
    kv_heads: tuple[int, int]
    heads: tuple[int, int]
    ffn: tuple[int, int]
    vocab: tuple[int, int]
    head_dim: int

    @classmethod
    def plan(cls, config: ModelConfig, world_size: int, rank: int) -> Shard:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {world_size!r}")
        if world_size > config.n_kv_heads:
            raise ValueError(f"tensor_parallel_size {world_size} exceeds the model's {config.n_kv_heads} KV heads: "
                             f"a KV head cannot be split across ranks (vLLM replicates KV heads instead)")
        group = config.n_heads // config.n_kv_heads   # query heads per KV head (GQA)
        kv = shard_range(config.n_kv_heads, world_size, rank)
        # F in whole quantization blocks: down's input columns are cut by blocks
        unit = BLOCK_SIZE if config.intermediate_size % BLOCK_SIZE == 0 else 1
        return cls(rank, world_size, kv, (kv[0] * group, kv[1] * group),
                   shard_range(config.intermediate_size, world_size, rank, unit),
                   shard_range(config.vocab_size, world_size, rank), config.head_dim)

    def keep(self, field: str, w: Weight) -> Weight:
        """The rank's part of the weight ``field`` (a LayerWeights or ModelWeights field name):
        Q/K/V by heads and gate/up by F (rows), O by heads and down by F (input columns), the
        embedding and LM head by vocabulary (rows); the norms whole (every rank normalizes the full x)."""
        (h0, h1), (k0, k1), (f0, f1), (v0, v1), dh = self.heads, self.kv_heads, self.ffn, self.vocab, self.head_dim
        cuts = {"wq": (rows, h0 * dh, h1 * dh), "wk": (rows, k0 * dh, k1 * dh), "wv": (rows, k0 * dh, k1 * dh),
                "wo": (columns, h0 * dh, h1 * dh), "w_gate": (rows, f0, f1), "w_up": (rows, f0, f1),
                "w_down": (columns, f0, f1), "embedding": (rows, v0, v1), "lm_head": (rows, v0, v1)}
        if field not in cuts:
            return w
        cut, start, stop = cuts[field]
        return cut(w, start, stop)

    def config(self, config: ModelConfig) -> ModelConfig:
        """The rank's view of the model: its heads and F. The vocabulary stays whole: token ids are
        checked against it, and the LM head's logits are gathered back to it."""
        return dataclasses.replace(config, n_heads=self.heads[1] - self.heads[0],
                                   n_kv_heads=self.kv_heads[1] - self.kv_heads[0],
                                   intermediate_size=self.ffn[1] - self.ffn[0])


def rows(w: Weight, start: int, stop: int) -> Weight:
    """Rows [start, stop) of w (out, in), copied: only the shard stays in memory."""
    if isinstance(w, QMatrix):
        return QMatrix(w.qtype, (stop - start, w.shape[1]), np.ascontiguousarray(w.data[start:stop]))
    return np.ascontiguousarray(w[start:stop])


def columns(w: Weight, start: int, stop: int) -> Weight:
    """Input columns [start, stop) of w (out, in), copied; packed weights in whole 32-value blocks."""
    if isinstance(w, QMatrix):
        if start % BLOCK_SIZE or stop % BLOCK_SIZE:
            raise ValueError(f"columns {start}:{stop} of a {w.qtype} weight are not whole {BLOCK_SIZE}-value blocks")
        per_block = BLOCK_BYTES[w.qtype]
        data = w.data[:, start // BLOCK_SIZE * per_block:stop // BLOCK_SIZE * per_block]
        return QMatrix(w.qtype, (w.shape[0], stop - start), np.ascontiguousarray(data))
    return np.ascontiguousarray(w[:, start:stop])


def read_shard(path: Path, world_size: int, rank: int) -> tuple[ModelConfig, Shard, ModelWeights]:
    """The whole model's config, the rank's Shard and its weights, read from a model file. GGUF
    tensors are views of the mapped file: only the shard's bytes are copied into memory."""
    config, weights = read_weights(Path(path), keep=lambda config: Shard.plan(config, world_size, rank).keep)
    return config, Shard.plan(config, world_size, rank), weights


def weight_bytes(weights: ModelWeights) -> int:
    """Bytes of every distinct array the weights hold: packed blocks and their SIMD repacking
    included, a tied LM head and the views of stacked matrices counted once."""
    weights_held = [weights.embedding, weights.lm_head, weights.final_norm]
    for layer in weights.layers:
        weights_held += [layer.attn_norm, layer.mlp_norm, layer.q_norm, layer.k_norm, layer.wo, layer.w_down,
                         *layer.qkv, *layer.gate_up]
    arrays = {}
    for w in weights_held:
        if isinstance(w, QMatrix):  # the file's bytes, and a RepackedMatrix's SIMD copies of them
            arrays |= {id(a): a for a in vars(w).values() if isinstance(a, np.ndarray)}
        elif w is not None:
            arrays[id(w)] = w
    return sum(a.nbytes for a in arrays.values())


class ShardedModel(Model):
    """One rank's model: the one forward on the rank's shard, with the collectives injected.

    ``all_reduce(x)`` sums x in place across the ranks (after attention's O and the FFN's down,
    and after the embedding lookup); ``gather(logits)`` brings every rank's vocabulary slice to
    rank 0 and returns the full (L, V) rows there, None elsewhere.
    """

    def __init__(self, config: ModelConfig, weights: ModelWeights, ops, shard: Shard,
                 all_reduce: Callable[[np.ndarray], np.ndarray], gather: Callable[[np.ndarray], np.ndarray | None]):
        super().__init__(shard.config(config), weights, ops)
        self.shard, self.all_reduce, self.gather = shard, all_reduce, gather
        self.context = dataclasses.replace(self.context, all_reduce=all_reduce)

    @classmethod
    def build(cls, config: ModelConfig, weights: ModelWeights, shard: Shard, backend: str, activations: str,
              all_reduce: Callable, gather: Callable) -> ShardedModel:
        """The rank's model from its weights as ``read_shard`` gives them."""
        check_load_options(backend, activations)
        if backend == "numba":
            weights = repack_linear_weights(weights, activations)
        return cls(config, weights, get_backend(backend), shard, all_reduce, gather)

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        """Each rank looks up the tokens of its vocabulary rows, zeros for the rest; the sum is the lookup."""
        v0, v1 = self.shard.vocab
        mine = (token_ids >= v0) & (token_ids < v1)                       # (N,)
        x = embed(np.where(mine, token_ids - v0, 0), self.weights.embedding, self.ops)  # (N, D)
        x[~mine] = 0.0
        return self.all_reduce(x)                                         # (N, D)

    def lm_head(self, x: np.ndarray) -> np.ndarray | None:
        return self.gather(linear(x, self.weights.lm_head, self.ops))     # (L, V) on rank 0: (L, V_r) gathered
