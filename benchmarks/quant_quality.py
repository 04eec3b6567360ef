"""What each weight format, int8 activations and an int8 KV cache cost in quality, against fp32.

    nice .venv/bin/python benchmarks/quant_quality.py     # ~1 minute; writes benchmarks/results/quant_quality.json

The reference is SmolLM2's Q4_1 file dequantized to float32: the file's own weights, not the
original bf16 checkpoint (which this course does not have). Each variant of
``minillm.model.quality.VARIANTS`` - the layers re-quantized to Q8_0 or Q4_0, the file as it is,
int8 activations, int8 K/V - reads two held-out texts, nothing downloaded: the prose of chapter 01
(its markdown cells) and code of the package (minillm/model/kv_cache.py past its docstring), the
first TOKENS tokens of each. Each text is read in one prefill that asks for every position's
logits (minillm.model.quality.variant_logits says why that is what decode computes). Each position's logits give
perplexity, KL(fp32 || variant) and top-1 agreement with fp32 (minillm/model/quality.py). Also
recorded: the KV bytes per token in float32 and in int8 with its scales. Quality figures do not
depend on the machine's load; the run time does (~20 s on a quiet 2-core machine, ~1-2 minutes on a busy one).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import ROOT, RESULTS, save_result

from minillm.generation.tokenizer import Tokenizer
from minillm.kernels.cpu.quant import BLOCK_BYTES, BLOCK_SIZE
from minillm.model.config import ModelConfig
from minillm.model.fetch import cached_model_path, fetch
from minillm.model.gguf import GGUFFile
from minillm.model.quality import (
    VARIANTS, WEIGHT_FORMATS, agreement, held_out_text, kv_bytes_per_token, perplexity, variant_logits,
)

TOKENS = 256
TEXTS = {"prose": ROOT / "chapters" / "01_hardware.ipynb", "code": ROOT / "minillm" / "model" / "kv_cache.py"}


def layer_bits(variant: str, file_format: str) -> float:
    """Bits per weight of the linear layers a variant runs (the file's format unless it names another)."""
    fmt = variant if variant in WEIGHT_FORMATS else file_format
    return 32.0 if fmt == "fp32" else 8 * BLOCK_BYTES[fmt] / BLOCK_SIZE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for quant_quality.json")
    args = parser.parse_args()
    path = cached_model_path() or fetch()
    tokenizer = Tokenizer.from_gguf(path)
    texts = {name: tokenizer.encode(held_out_text(file))[:TOKENS] for name, file in TEXTS.items()}
    logits = {}
    for variant in VARIANTS:  # fp32 first: the reference
        start = time.perf_counter()
        logits[variant] = dict(zip(texts, variant_logits(path, variant, list(texts.values()))))
        print(f"{variant:<17} {time.perf_counter() - start:5.1f} s", flush=True)
    gguf = GGUFFile(path)
    file_format = gguf.tensors["blk.0.attn_q.weight"].ggml_type  # SmolLM2's linear layers: Q4_1
    variants = {}
    for variant, by_text in logits.items():
        variants[variant] = {"description": VARIANTS[variant], "layer_bits_per_weight": layer_bits(variant, file_format)}
        for name, x in by_text.items():
            a = agreement(logits["fp32"][name], x)
            variants[variant][name] = {"perplexity": perplexity(x, texts[name]), "kl_mean": a.mean_kl,
                                       "kl_max": a.max_kl, "top1_agreement": a.top1, "positions": a.positions}
            print(f"{variant:<17} {name:<5} perplexity {variants[variant][name]['perplexity']:8.3f}  "
                  f"KL mean {a.mean_kl:.5f} max {a.max_kl:.4f} nats  top-1 {a.top1:6.1%}")
    config = ModelConfig.from_gguf(gguf)
    kv = {dtype: kv_bytes_per_token(config, dtype) for dtype in ("fp32", "int8")}
    print(f"KV bytes per token: fp32 {kv['fp32']:,}, int8 + scales {kv['int8']:,} ({kv['fp32'] / kv['int8']:.2f}x)")
    save_result("quant_quality", {
        "model": path.name, "reference": VARIANTS["fp32"], "tokens_per_text": TOKENS,
        "texts": {name: {"file": str(TEXTS[name].relative_to(ROOT)), "tokens": len(ids)} for name, ids in texts.items()},
        "variants": variants, "kv_bytes_per_token": kv,
    }, args.out)


if __name__ == "__main__":
    main()
