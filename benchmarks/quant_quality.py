"""What int8 activations cost in quality: minillm's int8 mode against its exact fp32 mode.

    .venv/bin/python benchmarks/quant_quality.py          # ~1 minute; writes benchmarks/results/quant_quality.json

Held-out texts, nothing downloaded: the course's own prose (chapters/glossary.md) and a code file of
the package (minillm/model/quality.py), the first TOKENS tokens of each. Each text is fed one token
at a time, as decode does (int8 mode changes only the one-row matvecs; prefill-sized batches run the
fp32 qmatmul in both modes), and each position's logits are compared (minillm/model/quality.py):
perplexity of each mode, KL(fp32 || int8) per position, and top-1 agreement.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from common import ROOT, RESULTS, save_result

from minillm.generation.tokenizer import Tokenizer
from minillm.model.fetch import cached_model_path, fetch
from minillm.model.loader import logits_by_activations
from minillm.model.quality import agreement, perplexity

TOKENS = 192
TEXTS = {"prose": ROOT / "chapters" / "glossary.md", "code": ROOT / "minillm" / "model" / "quality.py"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for quant_quality.json")
    args = parser.parse_args()
    path = cached_model_path() or fetch()
    tokenizer = Tokenizer.from_gguf(path)
    results = {"model": path.name, "tokens_per_text": TOKENS, "texts": {}}
    for name, file in TEXTS.items():
        ids = tokenizer.encode(file.read_text())[:TOKENS]
        logits = logits_by_activations(path, ids)  # {"fp32": (T, V), "int8": (T, V)}
        a = agreement(logits["fp32"], logits["int8"])
        results["texts"][name] = {
            "file": str(file.relative_to(ROOT)),
            "perplexity": {mode: perplexity(x, ids) for mode, x in logits.items()},
            "kl_fp32_to_int8_mean": a.mean_kl, "kl_fp32_to_int8_max": a.max_kl, "top1_agreement": a.top1,
            "positions": a.positions,
        }
        r = results["texts"][name]
        print(f"{name:5s}: perplexity fp32 {r['perplexity']['fp32']:.3f}, int8 {r['perplexity']['int8']:.3f}; "
              f"KL mean {a.mean_kl:.5f} max {a.max_kl:.5f} nats; top-1 {a.top1:.1%} of {a.positions}")
    save_result("quant_quality", results, args.out)


if __name__ == "__main__":
    main()
