"""Serving under load: ``minillm serve`` against llama-cpp-python's OpenAI server, same GGUF, same load.

    .venv/bin/python benchmarks/serving.py            # concurrency 1, 4, 16 with 64 requests each (long)
    .venv/bin/python benchmarks/serving.py --quick    # a smoke run: concurrency 1 and 4, 8 short requests

Each server runs in its own process on 127.0.0.1, alone on the machine (one after the other),
with the same threads (physical cores):
- minillm: ``minillm serve`` - continuous batching over the paged KV cache;
- llama.cpp: ``python -m llama_cpp.server --model <gguf> --n_threads <cores>`` - llama-cpp-python's
  server, which runs one request at a time (a lock around its single context). By default a new
  request *interrupts* the one streaming (``--interrupt_requests``); we turn that off, so requests
  queue and every one completes.
The same load generator (``minillm.serve.loadgen``, vLLM's protocol) drives both: random prompts of
``--input-len`` tokens, ``--output-len`` tokens out, temperature 0, streamed, with the requests
capped at the given concurrency. minillm gets ``ignore_eos``; llama-cpp-python does not know that
field, so it gets ``min_tokens = output_len`` (eos is masked until then - the same effect) and
``repeat_penalty = 1`` (its default is 1.1). It sends no usage chunk: its output tokens are counted
from the streamed chunks (one token each there).

Reported per concurrency: output tokens/s, TTFT and TPOT median and p99, and the ratio of output
throughput minillm / llama.cpp (> 1: minillm is faster). Results: benchmarks/results/serving.json.
A peer that is not installed is skipped with a message (llama.cpp: ``make bench-peers``).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import contender_env, save_result

from minillm.hardware.collectives import free_port
from minillm.hardware.machine import describe_machine
from minillm.llm import load_tokenizer
from minillm.model.fetch import cached_model_path, fetch
from minillm.serve.loadgen import LoadConfig, benchmark

START_TIMEOUT_S = 300


def minillm_command(model: Path, port: int, max_num_seqs: int) -> list[str]:
    return [sys.executable, "-m", "minillm", "serve", "--port", str(port), "--model", str(model),
            "--max-num-seqs", str(max_num_seqs)]


def llama_cpp_command(model: Path, port: int, threads: int, n_ctx: int) -> list[str]:
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads),
            "--n_ctx", str(n_ctx), "--interrupt_requests", "False", "--verbose", "False"]


class ServerProcess:
    """A server in its own process; its log goes to a temporary file, shown if it fails to start."""

    def __init__(self, command: list[str], port: int, threads: int):
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env=contender_env("native", threads))

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server did not start; its log:\n{Path(self.log.name).read_text()[-3000:]}")

    def stop(self) -> None:
        self.process.terminate()  # SIGTERM: uvicorn shuts down gracefully
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
        os.unlink(self.log.name)


def run_server(name: str, command: list[str], port: int, args, tokenizer, extra_body: dict) -> dict:
    server = ServerProcess(command, port, args.threads)
    try:
        server.wait_ready()
        for cap in (1, None):  # compile / page in before timing: one sequence per step, then a batch
            warmup = LoadConfig(base_url=server.url, num_prompts=2, input_len=args.input_len, output_len=4,
                                max_concurrency=cap, seed=99, extra_body=extra_body, progress=False)
            asyncio.run(benchmark(warmup, tokenizer))
        results = {}
        for concurrency in args.concurrency:
            config = LoadConfig(base_url=server.url, num_prompts=args.num_prompts, input_len=args.input_len,
                                output_len=args.output_len, max_concurrency=concurrency, seed=args.seed,
                                extra_body=extra_body)
            print(f"{name}: concurrency {concurrency}, {args.num_prompts} requests", flush=True)
            report = asyncio.run(benchmark(config, tokenizer))
            print(report.table(), flush=True)
            results[str(concurrency)] = report.summary
        return results
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: concurrency 1 and 4, 8 short requests")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None)
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--input-len", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--threads", type=int, default=describe_machine().cores)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    quick = {"concurrency": [1, 4], "num_prompts": 8, "input_len": 64, "output_len": 16}
    full = {"concurrency": [1, 4, 16], "num_prompts": 64, "input_len": 128, "output_len": 64}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    model = cached_model_path() or fetch()
    tokenizer = load_tokenizer(model)
    n_ctx = 2 * (args.input_len + args.output_len)
    contenders = [("minillm", minillm_command(model, (port := free_port()), max(args.concurrency)), port,
                   {"ignore_eos": True})]
    try:
        import llama_cpp.server  # noqa: F401
        contenders.append(("llama.cpp", llama_cpp_command(model, (port := free_port()), args.threads, n_ctx), port,
                           {"min_tokens": args.output_len, "repeat_penalty": 1.0}))
    except ImportError:
        print("llama-cpp-python[server] is not installed: skipping llama.cpp (make bench-peers installs it)")

    results = {name: run_server(name, command, port, args, tokenizer, extra)
               for name, command, port, extra in contenders}

    print(f"\n{'concurrency':>11}  {'server':<10}{'out tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'TPOT p50':>10}{'TPOT p99':>10}   (ms)")
    ratios = {}
    for concurrency in map(str, args.concurrency):
        for name in results:
            s = results[name][concurrency]
            print(f"{concurrency:>11}  {name:<10}{s['output_throughput']:>10.1f}{s['median_ttft_ms']:>10.0f}"
                  f"{s['p99_ttft_ms']:>10.0f}{s['median_tpot_ms']:>10.0f}{s['p99_tpot_ms']:>10.0f}")
        if "llama.cpp" in results:
            ratios[concurrency] = (results["minillm"][concurrency]["output_throughput"]
                                   / results["llama.cpp"][concurrency]["output_throughput"])
            print(f"{'':>11}  minillm / llama.cpp output throughput: {ratios[concurrency]:.2f}x")
    save_result("serving", {"settings": {"quick": args.quick, "concurrency": args.concurrency,
                                         "num_prompts": args.num_prompts, "input_len": args.input_len,
                                         "output_len": args.output_len, "threads": args.threads},
                            "servers": results, "output_throughput_ratio_minillm_over_llama_cpp": ratios})


if __name__ == "__main__":
    main()
