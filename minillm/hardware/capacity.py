"""Capacity: what must fit in a device's memory to serve a model, term by term.

    memory needed = weights + KV state + workspace

- **weights**: every parameter at its storage format's bytes per weight (a quantized format pays
  for its scales too: 8-bit weights in groups of 128 with an FP16 scale are 1 + 2/128 bytes each).
- **KV state**: each sequence keeps a key and a value vector per layer, per KV head, per token of
  its context: 2 x layers x KV heads x head dim x bytes per element, times batch x context. It
  grows with traffic; the weights don't. Grouped-query attention (GQA) shares one KV head among
  several query heads, which is what keeps this term small.
- **workspace**: the activations of one forward step (a lower bound: engines add their runtime's
  own buffers, which only a profile run can measure).

Weights fit, therefore the model runs: wrong. Whether the target batch and context fit is the
question, and beyond some batch x context the KV state outweighs the weights themselves.

This module is layer 1 and knows nothing of ``minillm.model``: a ``ModelShape`` is built from
plain numbers, or with ``ModelShape.like(config)`` from any object with the same field names
(``minillm.model.config.ModelConfig`` has them).
"""
from __future__ import annotations

from dataclasses import dataclass

from minillm.hardware.roofline import _check_positive

SHAPE_FIELDS = ("n_layers", "hidden_size", "intermediate_size", "n_heads", "n_kv_heads", "head_dim", "vocab_size")


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a Llama-style decoder (GQA attention, SwiGLU MLP, RMSNorm) that size its memory."""

    name: str
    n_layers: int
    hidden_size: int          # D
    intermediate_size: int    # F, the SwiGLU width
    n_heads: int              # H, query heads
    n_kv_heads: int           # Hkv, key/value heads
    head_dim: int             # Dh
    vocab_size: int           # V
    tied_embeddings: bool     # the LM head is the embedding matrix (no second V x D matrix)

    def __post_init__(self):
        for field in SHAPE_FIELDS:
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelShape.{field} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.n_heads} query heads cannot be shared evenly by {self.n_kv_heads} KV heads")

    @classmethod
    def like(cls, config, name: str) -> ModelShape:
        """From any object with these field names, e.g. a ``minillm.model.config.ModelConfig``."""
        return cls(name, **{field: getattr(config, field) for field in (*SHAPE_FIELDS, "tied_embeddings")})

    # -------------------------------------------------------------------------------------------
    # Parameters

    @property
    def linear_params(self) -> int:
        """The weight matrices of the blocks: what quantization shrinks and every decode step reads."""
        D, F, Dh = self.hidden_size, self.intermediate_size, self.head_dim
        attention = D * self.n_heads * Dh * 2 + D * self.n_kv_heads * Dh * 2    # q and o; k and v
        mlp = 3 * D * F                                                          # gate, up, down
        return self.n_layers * (attention + mlp)

    @property
    def other_params(self) -> int:
        """The embedding table, the LM head unless tied, and the RMSNorm weights (2 per layer + 1)."""
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        return embeddings + (2 * self.n_layers + 1) * self.hidden_size

    @property
    def n_params(self) -> int:
        return self.linear_params + self.other_params

    # -------------------------------------------------------------------------------------------
    # Per token of context

    def kv_bytes_per_token(self, kv_dtype_bytes: float) -> float:
        """K and V, every layer, every KV head: 2 x L x Hkv x Dh elements per token of context."""
        _check_positive(kv_dtype_bytes=kv_dtype_bytes)
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * kv_dtype_bytes

    def attention_flops_per_token(self, context: int) -> float:
        """FLOP of one new token's attention over ``context`` keys: q.k and p.v, 2 FLOP per
        multiply-add, over every query head of every layer (4 x L x H x Dh x context)."""
        if context < 0:
            raise ValueError(f"context must be >= 0 tokens, got {context}")
        return 4 * self.n_layers * self.n_heads * self.head_dim * context

    def activation_bytes_per_token(self, activation_bytes: float) -> float:
        """Activations one token holds at the widest point of a layer: the residual stream, its
        normed copy and the block's output (3 x D), plus the wider of attention's q, k, v and
        output (2 H + 2 Hkv heads of Dh) and the MLP's gate and up (2 x F)."""
        _check_positive(activation_bytes=activation_bytes)
        attention = (2 * self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        return (3 * self.hidden_size + max(attention, 2 * self.intermediate_size)) * activation_bytes


@dataclass(frozen=True)
class Capacity:
    weights_bytes: float
    kv_bytes: float
    workspace_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.kv_bytes + self.workspace_bytes

    def fits(self, memory_bytes: float) -> bool:
        return self.total_bytes <= memory_bytes


def weights_bytes(shape: ModelShape, bytes_per_weight: float, other_bytes_per_weight: float | None = None) -> float:
    """The blocks' matrices at ``bytes_per_weight``; embeddings, LM head and norms at
    ``other_bytes_per_weight`` (quantization recipes often keep them wider; default: the same)."""
    other = bytes_per_weight if other_bytes_per_weight is None else other_bytes_per_weight
    _check_positive(bytes_per_weight=bytes_per_weight, other_bytes_per_weight=other)
    return shape.linear_params * bytes_per_weight + shape.other_params * other


def workspace_bytes(shape: ModelShape, batch: int, activation_bytes: float) -> float:
    """One decode step's live activations for ``batch`` tokens, plus each sequence's FP32 logits
    (V floats, for sampling). A lower bound: no runtime buffers, no materialized attention scores."""
    _check_positive(batch=batch)
    return batch * (shape.activation_bytes_per_token(activation_bytes) + shape.vocab_size * 4)


def capacity(shape: ModelShape, bytes_per_weight: float, batch: int, context: int, kv_dtype_bytes: float,
             activation_bytes: float = 2.0, other_bytes_per_weight: float | None = None) -> Capacity:
    """Memory to decode ``batch`` sequences of ``context`` tokens each, term by term.

    ``activation_bytes`` is the dtype activations are computed in: 2 for BF16 on a GPU, 4 on a CPU
    that computes in FP32.
    """
    _check_positive(batch=batch)
    if context < 0:
        raise ValueError(f"context must be >= 0 tokens, got {context}")
    return Capacity(
        weights_bytes=weights_bytes(shape, bytes_per_weight, other_bytes_per_weight),
        kv_bytes=batch * context * shape.kv_bytes_per_token(kv_dtype_bytes),
        workspace_bytes=workspace_bytes(shape, batch, activation_bytes),
    )


def kv_crossover_tokens(shape: ModelShape, bytes_per_weight: float, kv_dtype_bytes: float,
                        other_bytes_per_weight: float | None = None) -> float:
    """batch x context at which the KV state weighs as much as the weights.

    Past it, serving more (or longer) conversations costs more memory than the model itself.
    """
    return (weights_bytes(shape, bytes_per_weight, other_bytes_per_weight)
            / shape.kv_bytes_per_token(kv_dtype_bytes))


def max_kv_tokens(shape: ModelShape, memory_bytes: float, bytes_per_weight: float, kv_dtype_bytes: float,
                  batch: int, activation_bytes: float = 2.0, other_bytes_per_weight: float | None = None) -> int:
    """Tokens of KV state (summed over the batch) that fit beside the weights and the workspace of
    a ``batch``-sequence step; 0 when even those don't fit."""
    _check_positive(memory_bytes=memory_bytes)
    fixed = capacity(shape, bytes_per_weight, batch, 0, kv_dtype_bytes, activation_bytes, other_bytes_per_weight)
    free = memory_bytes - fixed.total_bytes
    return max(0, int(free // shape.kv_bytes_per_token(kv_dtype_bytes)))


# ----------------------------------------------------------------------------------------------
# Published architectures (their config.json on Hugging Face)

# Llama 2 70B: grouped-query attention, 64 query heads sharing 8 KV heads (the 7B and 13B use MHA).
LLAMA2_70B = ModelShape("Llama-2-70B", n_layers=80, hidden_size=8192, intermediate_size=28672, n_heads=64,
                        n_kv_heads=8, head_dim=128, vocab_size=32000, tied_embeddings=False)

# Llama 3 70B: the same blocks, a 4x larger vocabulary (128,256 tokens) and an 8,192-token context.
LLAMA3_70B = ModelShape("Llama-3-70B", n_layers=80, hidden_size=8192, intermediate_size=28672, n_heads=64,
                        n_kv_heads=8, head_dim=128, vocab_size=128256, tied_embeddings=False)
