"""What a cheaper model costs in quality: next-token distributions compared with a reference.

A quantization format or an activation mode is judged on the model's output, not on the weights'
RMS error: over a held-out text, fed one token at a time, each position's logits give

- perplexity: exp(mean negative log-likelihood of the text's actual next tokens); lower is better;
- KL divergence KL(reference || candidate) of the next-token distributions, in nats: how much
  probability mass moved, even where the top token did not change;
- top-1 agreement: the share of positions where both pick the same most likely token (what greedy
  decoding sees).

The candidates (``VARIANTS``) are SmolLM2's GGUF file turned into other models. The reference is
that file's own weights dequantized to float32 - not the original bf16 checkpoint, which we do not
have: every figure measures what a format loses *from the file*, and the file's Q4_1 itself is
the reference up to float rounding. ``Int8KVCache`` rounds keys and values to int8 on their way
into the cache; it exists for this measurement only, so the engine's cache pays nothing for it.
"""
from __future__ import annotations

import ast
import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from minillm.kernels.cpu import quant
from minillm.kernels.quant_kv import dequantize_kv_int8, kv_bytes_per_vector, quantize_kv_int8
from minillm.kernels.registry import get_backend
from minillm.model.config import ModelConfig
from minillm.model.kv_cache import AttentionMetadata, ContiguousKVCache, KVCache
from minillm.model.loader import LINEAR_FIELDS, load_gguf_weights, load_model, repack_linear_weights
from minillm.model.transformer import Model, ModelWeights


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """(T, V) logits -> (T, V) log-probabilities, in float64 so that tiny KLs are not rounding noise."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def perplexity(logits: np.ndarray, token_ids) -> float:
    """exp(mean NLL) of token_ids[1:] under logits[:-1] (row t predicts token t + 1)."""
    ids = np.asarray(token_ids)
    if logits.shape[0] != len(ids) or len(ids) < 2:
        raise ValueError(f"need one logits row per token and at least 2 tokens, got {logits.shape} for {len(ids)} ids")
    logp = log_softmax(logits[:-1])                                   # (T - 1, V)
    return float(np.exp(-logp[np.arange(len(ids) - 1), ids[1:]].mean()))


@dataclass(frozen=True)
class Agreement:
    mean_kl: float       # nats, averaged over positions
    max_kl: float
    top1: float          # share of positions with the same argmax, 0..1
    positions: int


def agreement(reference: np.ndarray, candidate: np.ndarray) -> Agreement:
    """KL(reference || candidate) per position and top-1 agreement of two (T, V) logits arrays."""
    if reference.shape != candidate.shape:
        raise ValueError(f"logits shapes differ: {reference.shape} vs {candidate.shape}")
    p_log, q_log = log_softmax(reference), log_softmax(candidate)      # (T, V) each
    kl = (np.exp(p_log) * (p_log - q_log)).sum(axis=-1)               # (T,)
    same = reference.argmax(axis=-1) == candidate.argmax(axis=-1)     # (T,)
    return Agreement(float(kl.mean()), float(kl.max()), float(same.mean()), len(kl))


# -----------------------------------------------------------------------------
# the candidates: one GGUF file, turned into other models

VARIANTS = {
    "fp32": "the file's weights dequantized to float32 (embedding too): the reference",
    "Q8_0": "linear layers re-quantized to Q8_0 (8.5 bits a weight)",
    "Q4_1": "the file as it is: linear layers in Q4_1 (5 bits a weight)",
    "Q4_0": "linear layers re-quantized to Q4_0 (4.5 bits a weight)",
    "int8 activations": "the file, with each matvec's input rounded to int8 blocks (activations='int8')",
    "int8 KV": "the file, with K and V rounded to int8 per (token, head) on their way into the cache",
}
WEIGHT_FORMATS = ("fp32", "Q8_0", "Q4_1", "Q4_0")


class Int8KVCache(ContiguousKVCache):
    """A contiguous cache whose keys and values went through int8: each (token, head) vector is
    quantized with its own scale on the way in (kernels.quant_kv) and stored dequantized, so the
    unchanged float32 attention kernels read exactly what an int8 cache would give back."""

    def write(self, layer: int, k: np.ndarray, v: np.ndarray, meta: AttentionMetadata) -> None:
        k = dequantize_kv_int8(*quantize_kv_int8(k))  # (N, Hkv, Dh)
        v = dequantize_kv_int8(*quantize_kv_int8(v))  # (N, Hkv, Dh)
        super().write(layer, k, v, meta)


def kv_bytes_per_token(config: ModelConfig, dtype: str) -> int:
    """KV bytes one token occupies in a cache of ``dtype`` ("fp32", or "int8" with its scales):
    K and V, in every layer, for every KV head."""
    return 2 * config.n_layers * config.n_kv_heads * kv_bytes_per_vector(config.head_dim, dtype)


def weights_in_format(weights: ModelWeights, fmt: str) -> ModelWeights:
    """A GGUF file's packed weights in another format: "fp32" dequantizes every packed matrix
    (embedding and LM head too); a block format re-quantizes each linear layer's matrix that is
    not in it already, from its dequantized values, and keeps the embedding (the LM head of a tied
    model) as the file has it - as llama.cpp's mixes keep the output matrix at higher precision."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; known: {', '.join(WEIGHT_FORMATS)}")

    def convert(w):
        if not isinstance(w, quant.QMatrix) or w.qtype == fmt:
            return w
        values = quant.dequantize(w)                                     # (out, in) float32
        return values if fmt == "fp32" else quant.quantize(values, fmt)

    layers = [replace(layer, **{f: convert(getattr(layer, f)) for f in LINEAR_FIELDS}) for layer in weights.layers]
    if fmt != "fp32":
        return replace(weights, layers=layers)
    embedding = convert(weights.embedding)
    lm_head = embedding if weights.lm_head is weights.embedding else convert(weights.lm_head)
    return replace(weights, layers=layers, embedding=embedding, lm_head=lm_head)


def variant_model(path: str | Path, variant: str) -> Model:
    """The model of one of ``VARIANTS``, built from a GGUF file, on the numba backend."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
    if variant == "int8 activations":
        return load_model(path, activations="int8")
    config, weights = load_gguf_weights(Path(path))
    if variant in WEIGHT_FORMATS:
        weights = weights_in_format(weights, variant)
    return Model(config, repack_linear_weights(weights, "fp32"), get_backend("numba"))


def decode_logits(model: Model, token_ids, cache: KVCache) -> np.ndarray:
    """The logits (T, V) after each of token_ids (T,), fed one at a time as decode does."""
    ids = np.asarray(token_ids, dtype=np.int64)  # (T,)
    rows = [model.forward(ids[i:i + 1], AttentionMetadata(query_lens=[1], context_lens=[i], seq_slots=[0]), cache)[0]
            for i in range(len(ids))]            # (V,) each
    return np.stack(rows)                        # (T, V)


def prefill_logits(model: Model, token_ids, cache: KVCache) -> np.ndarray:
    """The same logits (T, V) from one forward over the whole text, every row asked for: each
    position still sees only the tokens before it (causal attention), and the weights are read
    once rather than T times - the same function as decode_logits, up to float summation order."""
    ids = np.asarray(token_ids, dtype=np.int64)  # (T,)
    meta = AttentionMetadata(query_lens=[len(ids)], context_lens=[0], seq_slots=[0], logits_indices=np.arange(len(ids)))
    return model.forward(ids, meta, cache)       # (T, V)


def variant_logits(path: str | Path, variant: str, texts: list) -> list[np.ndarray]:
    """For each text (a list of token ids), the variant's logits (T, V) after each token, from one
    prefill: every variant sees there the arithmetic a decode step would (int8 activations too: a
    prefill's linears give each row bit for bit its one-row result). An int8 cache as well:
    ``Int8KVCache`` rounds K/V before anything reads them, so each position attends to the int8
    K/V of the tokens before it and its own, which is what a decode step sees (an engine's prefill
    would use the fresh float K/V).
    """
    model = variant_model(path, variant)
    cache_type = Int8KVCache if variant == "int8 KV" else ContiguousKVCache
    return [prefill_logits(model, ids, cache_type(model.config, 1, len(ids))) for ids in texts]


def held_out_text(path: str | Path) -> str:
    """Text to measure on: a notebook's markdown cells (its prose), or a Python file's source past
    its module docstring (its code)."""
    path = Path(path)
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    if path.suffix != ".py":
        raise ValueError(f"held_out_text reads a .ipynb notebook or a .py file, not {path.name}")
    source = path.read_text()
    body = ast.parse(source).body
    has_docstring = bool(body) and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    lines = source.splitlines(keepends=True)
    return "".join(lines[body[0].end_lineno:] if has_docstring else lines).lstrip()
