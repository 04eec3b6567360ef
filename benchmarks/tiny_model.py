"""Tiny random models as GGUF files: for the CUDA simulator (tests/cuda, gpu.py --dry-run) and for
the fused decode tests (tests/test_fused_decode.py), which want every code layout in one model.

The simulator runs every GPU thread as a Python thread (~1 ms each), and a decode step launches one
warp per output row of every matrix: so its model (``SIMULATOR``) is as small as the kernels allow -
hidden 32 (one Q8_0 block per row), 2 heads of 16 (1 KV head), feed-forward 32, vocabulary 32,
2 layers. The tokenizer (in the file's metadata, so `LLM(path)` loads it) has one symbol per id and
one merge.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minillm.generation.tokenizer import BYTE_TO_SYMBOL
from minillm.kernels.quant_formats import quantize
from minillm.model.gguf import write_gguf

LINEAR = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class TinyShape:
    vocab: int = 32
    hidden: int = 32
    ffn: int = 32
    layers: int = 2
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 16
    context: int = 64


SIMULATOR = TinyShape()


def write_tiny_gguf(path: Path, arch: str = "llama", seed: int = 0, shape: TinyShape = SIMULATOR,
                    qtypes: dict[str, str] | None = None) -> Path:
    """Random weights in a llama or qwen3 file: each linear layer in its ``qtypes`` format (by the
    names of ``LINEAR``; default Q8_0), the embedding Q8_0 and tied, norms F32 around 1."""
    rng = np.random.default_rng(seed)
    qtypes = {kind: "Q8_0" for kind in LINEAR} | (qtypes or {})
    s = shape

    def linear(kind: str, rows: int, cols: int):
        return quantize((0.3 * rng.standard_normal((rows, cols))).astype(np.float32), qtypes.get(kind, "Q8_0"))

    def norm(n: int):
        return (1 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    tensors = {"token_embd.weight": linear("token_embd", s.vocab, s.hidden), "output_norm.weight": norm(s.hidden)}
    for i in range(s.layers):
        b = f"blk.{i}."
        tensors |= {b + "attn_norm.weight": norm(s.hidden),
                    b + "attn_q.weight": linear("attn_q", s.heads * s.head_dim, s.hidden),
                    b + "attn_k.weight": linear("attn_k", s.kv_heads * s.head_dim, s.hidden),
                    b + "attn_v.weight": linear("attn_v", s.kv_heads * s.head_dim, s.hidden),
                    b + "attn_output.weight": linear("attn_output", s.hidden, s.heads * s.head_dim),
                    b + "ffn_norm.weight": norm(s.hidden),
                    b + "ffn_gate.weight": linear("ffn_gate", s.ffn, s.hidden),
                    b + "ffn_up.weight": linear("ffn_up", s.ffn, s.hidden),
                    b + "ffn_down.weight": linear("ffn_down", s.hidden, s.ffn)}
        if arch == "qwen3":
            tensors |= {b + "attn_q_norm.weight": norm(s.head_dim), b + "attn_k_norm.weight": norm(s.head_dim)}
    # one printable symbol per id ("a", "b", ...), the last id the merge "ab"; no EOS, so no early stop
    tokens = [BYTE_TO_SYMBOL[b] for b in range(ord("a"), ord("a") + s.vocab - 1)] + ["ab"]
    metadata = {"general.architecture": arch, "general.name": f"tiny-{arch}", f"{arch}.block_count": s.layers,
                f"{arch}.context_length": s.context, f"{arch}.embedding_length": s.hidden,
                f"{arch}.feed_forward_length": s.ffn, f"{arch}.attention.head_count": s.heads,
                f"{arch}.attention.head_count_kv": s.kv_heads, f"{arch}.rope.freq_base": 10000.0,
                f"{arch}.attention.layer_norm_rms_epsilon": 1e-5, f"{arch}.vocab_size": s.vocab,
                "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["a b"]}
    return write_gguf(path, metadata, tensors)
