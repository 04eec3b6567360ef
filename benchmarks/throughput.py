"""Offline throughput, as nano-vllm's bench.py measures it, scaled to a CPU: many requests at once.

    .venv/bin/python benchmarks/throughput.py            # 64 requests, prompts and outputs 32-256 tokens
    .venv/bin/python benchmarks/throughput.py --quick    # a smoke run: 16 short requests
    .venv/bin/python benchmarks/throughput.py --num-requests 32 --input-len 16 128 --output-len 16 64

The workload: NUM_REQUESTS requests of random token ids (fixed seed), each with a random prompt
length and a random output length drawn uniformly from the given ranges; every request generates
exactly its output length (greedy, eos ignored). Throughput = generated tokens / wall time, the
prefills included.

Contenders, one process, one after the other, the same GGUF file and threads (physical cores):
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
does not depend on how many requests follow each other). Then the throughput-vs-batch curve of
minillm: max_num_seqs 1, 4, 16, 64. Results: benchmarks/results/throughput.json, with the ratios
minillm / each peer (> 1: minillm is faster).
"""
from __future__ import annotations

import argparse
import time

import numba
import numpy as np
from common import load_transformers_model, save_result

from minillm.generation.sampling import SamplingParams
from minillm.hardware.machine import describe_machine
from minillm.llm import load_tokenizer
from minillm.model.fetch import cached_model_path, fetch
from minillm.model.loader import load_model
from minillm.runtime.engine import LLMEngine
from minillm.runtime.paged_cache import bytes_per_token

SEED = 0
FIRST_ORDINARY_ID, LAST_PROMPT_ID = 17, 10_000  # random prompt ids: past SmolLM2's 17 control tokens
SETTLE_SECONDS = 0.5                            # between contenders: thread pools spin for a while after a run


def make_workload(n: int, input_len: tuple[int, int], output_len: tuple[int, int]) -> list[tuple[list[int], int]]:
    """n (prompt ids, output length) pairs, lengths uniform in the inclusive ranges."""
    rng = np.random.default_rng(SEED)
    return [(rng.integers(FIRST_ORDINARY_ID, LAST_PROMPT_ID, rng.integers(input_len[0], input_len[1] + 1)).tolist(),
             int(rng.integers(output_len[0], output_len[1] + 1))) for _ in range(n)]


# -----------------------------------------------------------------------------
# the contenders: run(workload) -> seconds, every request generating exactly its output length

def run_minillm(model, tokenizer, workload, max_num_seqs: int) -> float:
    longest = max(len(p) + n for p, n in workload)
    kv_bytes = bytes_per_token(model.config) * (longest + 16) * min(max_num_seqs, len(workload))  # no preemption
    engine = LLMEngine(model, tokenizer, kv_cache_bytes=kv_bytes, max_num_seqs=max_num_seqs)
    start = time.perf_counter()
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)) for p, n in workload]
    while engine.has_unfinished():
        engine.step()
    seconds = time.perf_counter() - start
    for rid, (_, n) in zip(ids, workload):
        if len(engine.pop_request(rid).outputs[0].token_ids) != n:
            raise RuntimeError(f"minillm request {rid} did not generate {n} tokens")
    if engine.scheduler.num_preemptions:
        raise RuntimeError("the KV cache was too small: requests were preempted")
    return seconds


class Transformers:
    name = "transformers"

    def __init__(self, path, threads):
        self.torch, self.model = load_transformers_model(path, threads)

    def run(self, workload) -> float:
        torch = self.torch
        width = max(len(p) for p, _ in workload)
        pad = self.model.config.pad_token_id or 0
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in workload])           # (B, width) left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in workload])       # (B, width)
        longest = max(n for _, n in workload)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                      max_new_tokens=longest, min_new_tokens=longest, pad_token_id=pad)
        seconds = time.perf_counter() - start
        if out.shape[1] != width + longest:
            raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, not {longest}")
        return seconds


class LlamaCpp:
    name = "llama.cpp"

    def __init__(self, path, threads):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=2048,
                         verbose=False)

    def run(self, workload) -> float:
        start = time.perf_counter()
        for prompt, n in workload:
            self.llm.reset()                           # a new sequence; eval overwrites the old KV entries
            self.llm.eval(prompt)
            for _ in range(n - 1):                     # the last token needs no forward of its own
                token = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
                self.llm.eval([token])
        return time.perf_counter() - start


def load_peer(cls, path, threads):
    try:
        return cls(path, threads)
    except ImportError as err:
        print(f"skipping {cls.name}: {err} (install the peers with `make bench-peers`)")
        return None


# -----------------------------------------------------------------------------
# the run

def tokens_per_s(workload, seconds: float) -> float:
    return sum(n for _, n in workload) / seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 16 requests, prompts 16-64, outputs 8-32")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--serial-requests", type=int, default=8, help="requests the batch-1 contenders run")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.input_len, args.output_len, args.serial_requests = 16, [16, 64], [8, 32], 4
    curve = [m for m in (1, 4, 16, 64) if m == 1 or m <= args.num_requests]

    path = cached_model_path() or fetch()
    threads = min(describe_machine().cores, numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(threads)
    model, tokenizer = load_model(path), load_tokenizer(path)
    workload = make_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len))
    serial = workload[:args.serial_requests]
    warmup = make_workload(2, (8, 8), (2, 2))
    print(f"{len(workload)} requests, prompts {args.input_len[0]}-{args.input_len[1]} tokens, outputs "
          f"{args.output_len[0]}-{args.output_len[1]} tokens ({sum(n for _, n in workload)} to generate); "
          f"serial contenders: the first {len(serial)}; {threads} threads; {path.name}")

    run_minillm(model, tokenizer, warmup, 2)  # compile every kernel
    results = {"quick": args.quick, "model": path.name, "threads": threads, "seed": SEED,
               "num_requests": len(workload), "input_len": args.input_len, "output_len": args.output_len,
               "serial_requests": len(serial), "engines": {}, "curve": []}
    engines = results["engines"]

    for max_num_seqs in curve:
        time.sleep(SETTLE_SECONDS)
        requests = serial if max_num_seqs == 1 else workload
        seconds = run_minillm(model, tokenizer, requests, max_num_seqs)
        point = {"max_num_seqs": max_num_seqs, "requests": len(requests), "seconds": seconds,
                 "tokens_per_s": tokens_per_s(requests, seconds)}
        results["curve"].append(point)
        print(f"minillm max_num_seqs {max_num_seqs:>2}: {point['tokens_per_s']:8.1f} tok/s "
              f"({len(requests)} requests, {seconds:.1f} s)")
    engines["minillm"] = results["curve"][-1] | {"batched": True}
    engines["minillm batch 1"] = results["curve"][0] | {"batched": False}

    for cls, batched in ((Transformers, True), (LlamaCpp, False)):
        peer = load_peer(cls, path, threads)
        if peer is None:
            continue
        peer.run(warmup)
        time.sleep(SETTLE_SECONDS)
        requests = workload if batched else serial
        seconds = peer.run(requests)
        engines[cls.name] = {"requests": len(requests), "seconds": seconds, "batched": batched,
                             "tokens_per_s": tokens_per_s(requests, seconds)}
        print(f"{cls.name:<23}{engines[cls.name]['tokens_per_s']:8.1f} tok/s ({len(requests)} requests, "
              f"{seconds:.1f} s{', one padded batch' if batched else ', one at a time'})")
        del peer

    ours = engines["minillm"]["tokens_per_s"]
    for name, r in engines.items():
        if name != "minillm":
            results[f"ratio_minillm_over_{name.replace(' ', '_')}"] = ours / r["tokens_per_s"]
            print(f"minillm (max_num_seqs {curve[-1]}) / {name}: {ours / r['tokens_per_s']:.2f}x")
    save_result("throughput", results)


if __name__ == "__main__":
    main()
