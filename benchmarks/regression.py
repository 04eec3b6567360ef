"""No regression: this checkout's engine against an earlier commit's, on the same machine in one run.

    .venv/bin/python benchmarks/regression.py                  # against f0bbb69 (before issue 28's redesign)
    .venv/bin/python benchmarks/regression.py --baseline HEAD~3 --repeats 7

The earlier commit's package is exported (``git archive``) to a temporary folder and put first on the
import path of its worker process (``Contender.paths``), so that the two engines run the very same
harness (``contenders.Minillm``) and differ only in the package they import - each stamp records
which. Measured as the benchmarks that define each figure measure it: decode tokens/s and prefill
tokens/s as ``decode.py`` does (a 20-token prompt, 1 and ``--new-tokens`` new tokens; a
``--prefill-tokens`` prompt), and offline throughput as ``throughput.py`` does (``make_workload``,
every request at once, ``--max-num-seqs``). Repeats interleaved, medians, ratios this / baseline
(> 1: this checkout is faster). The issue's bound, recorded and not asserted: every ratio >= 0.97.
Results: benchmarks/results/regression.json (``--isa avx2``: regression_avx2.json, both engines on
the AVX2 code path; ``--activations int8``: _int8 added, both engines in int8 mode). About 5 minutes on 2 cores with the defaults.
"""
from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from common import (BENCHMARKS, SETTLE_SECONDS, Contender, add_isa_and_out, default_threads, interleaved, ratios,
                    result_name, save_result, start_all, summarize)
from decode import PROMPT_TOKENS, decode_and_prefill, repeat_prompts, warm_up
from throughput import make_workload

ROOT = BENCHMARKS.parent
BOUND = 0.97  # the "within 3%"


def export(revision: str, into: Path) -> str:
    """The package of ``revision`` under ``into`` (git archive), -> the commit's full hash."""
    commit = subprocess.run(["git", "rev-parse", revision], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    archive = subprocess.run(["git", "archive", commit, "minillm"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return commit


def measure(workers: dict, args, workload: list) -> dict[str, dict[str, list[float]]]:
    """Every figure of every contender, one value per repeat, the contenders taking turns."""
    rng = np.random.default_rng(0)
    for worker in workers.values():
        warm_up(worker, rng, args.prefill_tokens)
        worker.call("run_workload", workload=workload[:4], max_num_seqs=4)
    prompts = repeat_prompts(rng, args.prefill_tokens, args.repeats)
    expected = sum(n for _, n in workload)
    values = {name: {"decode_tokens_per_s": [], "prefill_tokens_per_s": [], "throughput_tokens_per_s": []}
              for name in workers}
    for repeat, name in interleaved(list(workers), args.repeats):
        worker, p, v = workers[name], prompts[repeat], values[name]
        time.sleep(SETTLE_SECONDS)
        _, decode_rate, prefill_rate = decode_and_prefill(worker, p, args.new_tokens, args.prefill_tokens)
        time.sleep(SETTLE_SECONDS)
        generated, seconds = worker.call("run_workload", workload=workload, max_num_seqs=args.max_num_seqs)
        if generated != expected:
            raise RuntimeError(f"{name} generated {generated} tokens of the workload, not {expected}")
        v["decode_tokens_per_s"].append(decode_rate)
        v["prefill_tokens_per_s"].append(prefill_rate)
        v["throughput_tokens_per_s"].append(generated / seconds)
        print(f"  repeat {repeat + 1}/{args.repeats} {name}: " + ", ".join(f"{k} {x[-1]:.1f}" for k, x in v.items()))
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default="f0bbb69", help="the earlier commit (default: f0bbb69)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 128))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 128))
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--activations", choices=("fp32", "int8"), default="fp32",
                        help="both engines' activation mode (int8: regression_int8.json)")
    add_isa_and_out(parser, "regression")
    args = parser.parse_args()
    threads = default_threads()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "minillm"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as folder:
        baseline = export(args.baseline, Path(folder))
        this, earlier = f"minillm {head[:7]}", f"minillm {baseline[:7]}"
        mode = {"mode": args.activations}
        contenders = [Contender(this, "Minillm", mode), Contender(earlier, "Minillm", mode, paths={args.isa: (Path(folder),)})]
        workers = start_all(contenders, args.isa, threads)
        workload = make_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len))
        print(f"[{args.isa}, {args.activations}] {this} (this checkout) against {earlier}: {threads} threads, "
              f"{args.repeats} repeats")
        try:
            values = measure(workers, args, workload)
        finally:
            for worker in workers.values():
                worker.close()
    figures = {name: {kind: summarize(v) for kind, v in per.items()} for name, per in values.items()}
    ratio = {kind: ratios({name: figures[name][kind]["median"] for name in figures}, this)[earlier]
             for kind in figures[this]}
    for kind, r in ratio.items():
        print(f"{kind}: {this} / {earlier} = {r:.3f}{'' if r >= BOUND else f'  (below the bound {BOUND})'}")
    save_result(result_name("regression", args.isa, args.activations), {
        "baseline": baseline, "this": head, "this_has_uncommitted_changes": bool(dirty), "isa": args.isa,
        "activations": args.activations, "threads": threads, "repeats": args.repeats,
        "decode": {"prompt_tokens": PROMPT_TOKENS, "new_tokens": args.new_tokens},
        "prefill_tokens": args.prefill_tokens,
        "throughput_workload": {"num_requests": args.num_requests, "input_len": list(args.input_len),
                                "output_len": list(args.output_len), "max_num_seqs": args.max_num_seqs},
        "stamps": {name: w.stamp for name, w in workers.items()},
        "figures": figures, "ratios_this_over_baseline": ratio, "bound": BOUND,
        "within_bound": all(r >= BOUND for r in ratio.values())}, args.out)


if __name__ == "__main__":
    main()
