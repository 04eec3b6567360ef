"""A tiny random model as a GGUF file with Q8_0 weights, for the CUDA simulator (tests, gpu.py --dry-run).

The simulator runs every GPU thread as a Python thread (~1 ms each), and a decode step launches one
warp per output row of every matrix: so the model is as small as the kernels allow - hidden 32
(one Q8_0 block per row), 2 heads of 16 (1 KV head), feed-forward 32, vocabulary 32, 2 layers.
Its tokenizer (in the file's metadata, so `LLM(path)` loads it) has one symbol per id and one merge.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from minillm.generation.tokenizer import BYTE_TO_SYMBOL
from minillm.kernels.quant_formats import quantize
from minillm.model.gguf import write_gguf

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, CONTEXT = 32, 32, 32, 2, 2, 1, 64


def write_tiny_gguf(path: Path, arch: str = "llama", seed: int = 0) -> Path:
    """Random weights (linear and embedding Q8_0, tied; norms F32 around 1) in a llama or qwen3 file."""
    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS

    def linear(rows: int, cols: int):
        return quantize((0.3 * rng.standard_normal((rows, cols))).astype(np.float32), "Q8_0")

    def norm(n: int):
        return (1 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    tensors = {"token_embd.weight": linear(VOCAB, HIDDEN), "output_norm.weight": norm(HIDDEN)}
    for i in range(LAYERS):
        b = f"blk.{i}."
        tensors |= {b + "attn_norm.weight": norm(HIDDEN), b + "attn_q.weight": linear(HEADS * head_dim, HIDDEN),
                    b + "attn_k.weight": linear(KV_HEADS * head_dim, HIDDEN),
                    b + "attn_v.weight": linear(KV_HEADS * head_dim, HIDDEN),
                    b + "attn_output.weight": linear(HIDDEN, HEADS * head_dim), b + "ffn_norm.weight": norm(HIDDEN),
                    b + "ffn_gate.weight": linear(FFN, HIDDEN), b + "ffn_up.weight": linear(FFN, HIDDEN),
                    b + "ffn_down.weight": linear(HIDDEN, FFN)}
        if arch == "qwen3":
            tensors |= {b + "attn_q_norm.weight": norm(head_dim), b + "attn_k_norm.weight": norm(head_dim)}
    metadata = {"general.architecture": arch, "general.name": f"tiny-{arch}", f"{arch}.block_count": LAYERS,
                f"{arch}.context_length": CONTEXT, f"{arch}.embedding_length": HIDDEN,
                f"{arch}.feed_forward_length": FFN, f"{arch}.attention.head_count": HEADS,
                f"{arch}.attention.head_count_kv": KV_HEADS, f"{arch}.rope.freq_base": 10000.0,
                f"{arch}.attention.layer_norm_rms_epsilon": 1e-5, f"{arch}.vocab_size": VOCAB,
                "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": TOKENS, "tokenizer.ggml.merges": ["a b"]}
    return write_gguf(path, metadata, tensors)


# one printable symbol per id ("a", "b", ...), the last id the merge "ab"; no EOS, so no early stop
TOKENS = [BYTE_TO_SYMBOL[b] for b in range(ord("a"), ord("a") + VOCAB - 1)] + ["ab"]
