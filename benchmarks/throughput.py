"""Offline throughput, as nano-vllm's bench.py measures it, scaled to a CPU: many requests at once.

    .venv/bin/python benchmarks/throughput.py            # 64 requests, prompts and outputs 32-256 tokens
    .venv/bin/python benchmarks/throughput.py --quick    # a smoke run: 16 short requests
    .venv/bin/python benchmarks/throughput.py --num-requests 32 --input-len 16 128 --output-len 16 64
    .venv/bin/python benchmarks/throughput.py --quick --isa avx2 --out /tmp/b   # the AVX2 code path, to /tmp/b
    .venv/bin/python benchmarks/throughput.py --activations int8   # minillm in int8 mode: throughput_int8.json

The workload: NUM_REQUESTS requests of random token ids (fixed seed), each with a random prompt
length and a random output length drawn uniformly from the given ranges; every request generates
exactly its output length (greedy, eos ignored). Throughput = generated tokens / wall time, the
prefills included.

Contenders, each in a worker process of its own (benchmarks/common.py), the same GGUF file and threads
(physical cores), adapters in benchmarks/contenders.py:
- minillm: ``LLMEngine`` with every request added at once, max_num_seqs 64 (continuous batching,
  chunked prefill, a KV cache big enough that nothing is preempted);
- minillm, batch 1: the same engine with max_num_seqs 1 - one request after the other;
- transformers: one batched ``generate`` over all requests, left padding, fp32 weights dequantized
  from the same GGUF, PyTorch eager. A padded batch is static: it runs until its longest output
  is done, so it computes max(output lengths) tokens for every row; only the tokens each request
  asked for count as generated;
- llama.cpp: ``llama_cpp.Llama``, requests one after the other (its Python API serves one
  sequence); skipped with a message when llama-cpp-python is not installed (``make bench-peers``).
The two serial contenders run on the first SERIAL_REQUESTS requests only (tokens/s of a serial run
does not depend on how many requests follow each other). minillm also runs max_num_seqs 4 and 16:
the throughput-vs-batch curve 1, 4, 16, 64. Every run is repeated (``--repeats``, 3 by default),
interleaved (minillm's curve, transformers, llama.cpp, then again), medians reported with every
repeat. Results: benchmarks/results/throughput.json (throughput_int8.json for ``--activations int8``:
minillm's contenders in int8 mode, whose batched decode past 8 streams runs the integer kernel),
with the ratios minillm / each peer (> 1: minillm is faster). The int8 run took 10 minutes on the
2-core Xeon VM, transformers' padded batch ~1.5 of them a repeat.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from common import (LLAMA_CPP, SETTLE_SECONDS, TRANSFORMERS, add_isa_and_out, default_threads, interleaved, minillm,
                    random_prompt, ratios, result_name, save_result, start_workers)

from minillm.model.fetch import cached_model_path, fetch

SEED = 0
CURVE = (1, 4, 16, 64)


def make_workload(n: int, input_len: tuple[int, int], output_len: tuple[int, int]) -> list[tuple[list[int], int]]:
    """n (prompt ids, output length) pairs, lengths uniform in the inclusive ranges."""
    rng = np.random.default_rng(SEED)
    return [(random_prompt(rng, int(rng.integers(input_len[0], input_len[1] + 1))),
             int(rng.integers(output_len[0], output_len[1] + 1))) for _ in range(n)]


def warmups(largest_batch: int) -> list[tuple[int, list[tuple[list[int], int]]]]:
    """(max_num_seqs, workload) runs that meet every kernel the timed runs meet before they are timed:
    8 requests ending one step apart (decode batches of 8, 7, ..., 1 rows: the fused decode step
    compiles a kernel per row count, seconds each the first time), then one batch of the largest size."""
    rng = np.random.default_rng(SEED + 1)
    staggered = [(random_prompt(rng, 8), n) for n in range(2, 10)]
    return [(8, staggered), (largest_batch, make_workload(largest_batch, (8, 8), (2, 2)))]


def runs(workload, serial, curve, minillm_worker: str) -> dict[str, tuple[str, dict, bool]]:
    """Each measured run: name -> (worker, run_workload's arguments, batched)."""
    table = {f"minillm max_num_seqs {m}": (minillm_worker, {"workload": serial if m == 1 else workload, "max_num_seqs": m},
                                           m > 1) for m in curve}
    table["transformers"] = ("transformers", {"workload": workload}, True)
    table["llama.cpp"] = ("llama.cpp", {"workload": serial}, False)
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 16 requests, prompts 16-64, outputs 8-32")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--serial-requests", type=int, default=8, help="requests the batch-1 contenders run")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every run (medians reported)")
    parser.add_argument("--activations", choices=["fp32", "int8"], default="fp32",
                        help="minillm's activation mode; int8 results go to throughput_int8.json")
    add_isa_and_out(parser, "throughput")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.input_len, args.output_len, args.serial_requests = 16, [16, 64], [8, 32], 4
    curve = [m for m in CURVE if m == 1 or m <= args.num_requests]
    threads = default_threads()
    workload = make_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len))
    serial = workload[:args.serial_requests]
    print(f"{len(workload)} requests, prompts {args.input_len[0]}-{args.input_len[1]} tokens, outputs "
          f"{args.output_len[0]}-{args.output_len[1]} tokens ({sum(n for _, n in workload)} to generate); "
          f"serial contenders: the first {len(serial)}; {threads} threads; {args.isa} code; minillm {args.activations}; "
          f"{args.repeats} repeats")

    contender = minillm(args.activations)
    workers = {w.name: w for w in start_workers([contender, TRANSFORMERS, LLAMA_CPP], args.isa, threads)}
    if contender.name not in workers:
        raise SystemExit("minillm is needed: see the message above")
    table = {name: run for name, run in runs(workload, serial, curve, contender.name).items() if run[0] in workers}
    for name, worker in workers.items():  # compile every kernel, wake the thread pools
        if name.startswith("minillm"):
            for batch, requests in warmups(curve[-1]):
                worker.call("run_workload", workload=requests, max_num_seqs=batch)
        else:
            worker.call("run_workload", workload=make_workload(2, (8, 8), (2, 2)))

    seconds = {name: [] for name in table}
    for repeat, name in interleaved(list(table), args.repeats):
        worker_name, kwargs, _ = table[name]
        time.sleep(SETTLE_SECONDS)
        generated, s = workers[worker_name].call("run_workload", **kwargs)
        expected = sum(n for _, n in kwargs["workload"])
        if generated != expected:
            raise RuntimeError(f"{name} generated {generated} tokens, not {expected}")
        seconds[name].append(s)
        print(f"  repeat {repeat + 1}/{args.repeats} {name:<24}{expected / s:8.1f} tok/s "
              f"({len(kwargs['workload'])} requests, {s:.1f} s)")
    for worker in workers.values():
        worker.close()

    # The layout chapter 08 reads: engines "minillm" (max_num_seqs 64), "minillm batch 1" and the peers,
    # and minillm's curve; tokens/s are medians, every repeat beside them.
    def summary(name: str) -> dict:
        worker_name, kwargs, batched = table[name]
        tokens = sum(n for _, n in kwargs["workload"])
        return {"requests": len(kwargs["workload"]), "batched": batched, "stamp": workers[worker_name].stamp,
                "seconds": statistics.median(seconds[name]),
                "tokens_per_s": statistics.median(tokens / s for s in seconds[name]),
                "tokens_per_s_all": [tokens / s for s in seconds[name]]}

    curve_names = [f"minillm max_num_seqs {m}" for m in curve]
    labels = {"minillm": curve_names[-1], "minillm batch 1": curve_names[0], "transformers": "transformers",
              "llama.cpp": "llama.cpp"}
    engines = {label: summary(name) for label, name in labels.items() if name in table}
    results = {"quick": args.quick, "model": (cached_model_path() or fetch()).name, "isa": args.isa,
               "activations": args.activations,
               "threads": threads, "seed": SEED, "repeats": args.repeats, "num_requests": len(workload),
               "input_len": args.input_len, "output_len": args.output_len, "serial_requests": len(serial),
               "engines": engines,
               "curve": [{"max_num_seqs": int(name.rsplit(" ", 1)[1]), **summary(name)} for name in curve_names]}
    for name, ratio in ratios({n: e["tokens_per_s"] for n, e in engines.items()}, "minillm").items():
        results[f"ratio_minillm_over_{name.replace(' ', '_')}"] = ratio
        print(f"minillm (max_num_seqs {curve[-1]}) / {name}: {ratio:.2f}x")
    save_result(result_name("throughput", activations=args.activations), results, args.out)


if __name__ == "__main__":
    main()
