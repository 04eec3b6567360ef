"""Scale-out: what crossing processes costs on this machine, written to benchmarks/results/scale_out.json.

    .venv/bin/python benchmarks/scale_out.py                        # every registered section
    .venv/bin/python benchmarks/scale_out.py --quick --out /tmp/x   # a smoke run (fewer sizes, 3 repeats)
    .venv/bin/python benchmarks/scale_out.py --backend nccl         # on a machine with 2+ GPUs

Sections, each a function of the parsed arguments returning one JSON-ready dict:

- ``allreduce``: all-reduce (sum, fp32) between ``--world-size`` processes over message sizes from
  4 B to 16 MiB, interleaved repeats, medians, and the alpha-beta fit (minillm.hardware.collectives);
  plus what that fit predicts a SmolLM2 decode step's all-reduces cost under tensor parallelism.

- ``tensor_parallel``: SmolLM2 on 1 process of 2 threads against 2 ranks of 1 thread (the same
  cores), each contender in a process of its own, interleaved repeats, medians: decode tok/s (one
  sequence) with the share of a decode step each rank spends inside collectives, prefill tok/s
  (a 512-token prompt in one step), the logits gathered per decode step, and memory per rank
  (weight bytes, and each process's resident set).

- ``replicas``: SmolLM2 served through one OpenAI endpoint from 1 replica of 2 threads, and from 2
  replicas of 1 thread (the same cores) on Ray Serve under each routing policy (round robin, least
  loaded, cache-aware; minillm.serve.replicas): a workload of 4 shared system prompts sent at a
  steady rate, with a KV cache per replica too small for all 4 at once. Output tok/s, TTFT, and
  the prefix-cache hit rate over the replicas (prompt tokens found cached / looked up).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import asdict
from pathlib import Path

from common import SETTLE_SECONDS, add_isa_and_out, save_result

from minillm.hardware import collectives

SMOLLM2_HIDDEN, SMOLLM2_LAYERS = 576, 30  # the default model's D and layer count


def allreduce(args) -> dict:
    sizes = collectives.DEFAULT_SIZES[::2] if args.quick else collectives.DEFAULT_SIZES
    sweep = collectives.allreduce_sweep(world_size=args.world_size, backend=args.backend, sizes=sizes,
                                        repeats=3 if args.quick else 9)
    for n, t in zip(sweep.message_bytes, sweep.median_seconds):
        print(f"all-reduce {n:>10,} B: {t * 1e6:10.1f} us  ({n / t / 1e9:6.3f} GB/s of message)")
    fit = sweep.fit
    step = collectives.tp_communication(SMOLLM2_HIDDEN, SMOLLM2_LAYERS, args.world_size, fit)
    print(f"alpha-beta fit: alpha {fit.alpha_s * 1e6:.1f} us, beta {fit.beta_bytes_per_s / 1e9:.2f} GB/s; "
          f"a SmolLM2 decode step's {step.allreduces_per_step} all-reduces: {step.seconds_per_step * 1e3:.2f} ms")
    return {"backend": args.backend, "world_size": args.world_size, "message_bytes": sweep.message_bytes,
            "median_seconds": sweep.median_seconds, "alpha_s": fit.alpha_s,
            "beta_bytes_per_s": fit.beta_bytes_per_s, "smollm2_decode_step": asdict(step)}


# -----------------------------------------------------------------------------
# tensor parallelism: TP = 1 against TP = 2 on the same cores

class TensorParallel:
    """The contender a ``common.Worker`` builds: ``minillm.LLM`` over ``size`` ranks of ``threads`` each."""

    def __init__(self, threads: int, size: int):
        import numba

        import minillm

        numba.set_num_threads(threads)
        self.size = size
        self.llm = minillm.LLM(tensor_parallel_size=size, kv_cache_bytes=256 << 20)

    def stamp(self) -> dict:
        import numba
        from common import numba_target

        return {"isa": numba_target()["isa"], "tensor_parallel_size": self.size,
                "numba_threads_per_rank": numba.get_num_threads() if self.size == 1 else self.llm.tensor_parallel.threads}

    def _timings(self, reset: bool) -> list | None:
        group = self.llm.tensor_parallel
        return None if group is None else group.timings(reset=reset)

    def decode(self, prompt: list[int], new_tokens: int) -> dict:
        """Decode tok/s of one sequence after its prefill; each rank's share of a step in collectives."""
        from minillm.generation.sampling import SamplingParams

        engine = self.llm.engine
        request = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=new_tokens + 1, ignore_eos=True))
        engine.step()                      # the prefill (and first token): not timed
        self._timings(reset=True)
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        seconds = time.perf_counter() - start
        engine.pop_request(request)
        timings = self._timings(reset=True)
        result = {"tok_per_s": new_tokens / seconds}
        if timings:
            result["collective_share_per_rank"] = [t.collective_share for t in timings]
            result["gathered_bytes_per_step"] = timings[0].gathered_bytes / timings[0].steps
        return result

    def prefill(self, prompt: list[int]) -> dict:
        """Prefill tok/s of one prompt run in one step (max_num_batched_tokens covers it)."""
        from minillm.generation.sampling import SamplingParams

        engine = self.llm.engine
        request = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        seconds = time.perf_counter() - start
        engine.pop_request(request)
        return {"tok_per_s": len(prompt) / seconds}

    def memory(self) -> dict:
        """Weight bytes each rank holds (packed blocks plus their SIMD repacking) and every process's RSS."""
        from minillm.model.loader import read_weights
        from minillm.model.sharding import read_shard, weight_bytes

        group = self.llm.tensor_parallel
        pids = [os.getpid()] + ([] if group is None else [p.pid for p in group.workers])
        file_bytes = [weight_bytes(read_weights(self.llm.path)[1])] if group is None else [
            weight_bytes(read_shard(self.llm.path, self.size, r)[2]) for r in range(self.size)]
        return {"packed_weight_bytes_per_rank": file_bytes,
                "rank0_weight_bytes_in_memory": weight_bytes(self.llm.model.weights),
                "rss_bytes_per_rank": [resident_bytes(pid) for pid in pids]}


def resident_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def tensor_parallel(args) -> dict:
    import numpy as np

    from common import Contender, Worker, interleaved, random_prompt, summarize

    cores = 2  # the same cores for both: 1 process x 2 threads, 2 ranks x 1 thread
    contenders = {"tp1": (Contender("tp1", "TensorParallel", {"size": 1}, source=Path(__file__)), cores),
                  "tp2": (Contender("tp2", "TensorParallel", {"size": 2}, source=Path(__file__)), cores // 2)}
    workers = {name: Worker(c, args.isa, threads) for name, (c, threads) in contenders.items()}
    rng = np.random.default_rng(0)
    new_tokens, prompt_len = (16, 128) if args.quick else (64, 512)
    runs: dict[str, dict[str, list]] = {name: {"decode": [], "prefill": []} for name in workers}
    try:
        for w in workers.values():   # warm-up: compile (the first calls of a fresh cache are slow), fault weights in
            for _ in range(2):
                w.call("decode", prompt=random_prompt(rng, 16), new_tokens=4)
                w.call("prefill", prompt=random_prompt(rng, prompt_len))
        for _, name in interleaved(list(workers), 2 if args.quick else 5):
            time.sleep(SETTLE_SECONDS)
            runs[name]["decode"].append(workers[name].call("decode", prompt=random_prompt(rng, 16),
                                                           new_tokens=new_tokens)[0])
            time.sleep(SETTLE_SECONDS)
            runs[name]["prefill"].append(workers[name].call("prefill", prompt=random_prompt(rng, prompt_len))[0])
        results = {"new_tokens": new_tokens, "prompt_tokens": prompt_len, "cores": cores}
        for name, w in workers.items():
            decode, prefill = runs[name]["decode"], runs[name]["prefill"]
            results[name] = {"stamp": w.stamp, "decode_tok_per_s": summarize([d["tok_per_s"] for d in decode]),
                             "prefill_tok_per_s": summarize([p["tok_per_s"] for p in prefill]),
                             "memory": w.call("memory")[0]}
            if "collective_share_per_rank" in decode[0]:
                shares = np.array([d["collective_share_per_rank"] for d in decode])   # (repeats, ranks)
                results[name]["decode_collective_share_per_rank"] = np.median(shares, axis=0).tolist()
                results[name]["gathered_bytes_per_decode_step"] = decode[0]["gathered_bytes_per_step"]
            print(f"{name}: decode {results[name]['decode_tok_per_s']['median']:.1f} tok/s, prefill "
                  f"{results[name]['prefill_tok_per_s']['median']:.0f} tok/s, "
                  f"collective share {results[name].get('decode_collective_share_per_rank', '-')}")
    finally:
        for w in workers.values():
            w.close()
    return results


# -----------------------------------------------------------------------------
# replicas on Ray Serve: 1 replica of 2 threads against 2 of 1 thread under each routing policy

REPLICA_KV_CACHE_BYTES = 27 << 20  # ~36 blocks per replica: fewer than the 4 system prompts need (48)


def replicas(args) -> dict:
    """Served throughput, TTFT and prefix-cache hit rate on a shared-system-prompt workload; fresh
    replicas for every run, the configurations interleaved, medians of the repeats."""
    from common import interleaved, summarize

    from minillm.serve.replicas import SharedPrefixWorkload, measure_routing

    workload = SharedPrefixWorkload(num_requests=16 if args.quick else 24)  # 4 system prompts of 192 tokens
    configs = {"1x2": (1, 2, "round-robin"), **{f"2x1 {routing}": (2, 1, routing)
                                                 for routing in ("round-robin", "least-loaded", "cache-aware")}}
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for repeat, name in interleaved(list(configs), 1 if args.quick else 2):
        num_replicas, threads, routing = configs[name]
        workload.seed = repeat  # every configuration of a repeat gets the same prompts
        run = asyncio.run(measure_routing(routing, workload, num_replicas, threads,
                                          kv_cache_bytes=REPLICA_KV_CACHE_BYTES, max_num_seqs=16))
        print(f"{name}: prefix-cache hit rate {run['prefix_cache_hit_rate']:.1%}, mean TTFT {run['mean_ttft_ms']:.0f} ms, "
              f"output {run['output_throughput']:.1f} tok/s, requests per replica {run['requests_per_replica']}")
        runs[name].append(run | {"load_average_1min": os.getloadavg()[0]})  # a busy machine shows here
    figures = ("prefix_cache_hit_rate", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "output_throughput",
               "request_throughput", "mean_tpot_ms")
    results = {"workload": {k: v for k, v in asdict(workload).items() if k != "seed"},
               "kv_cache_bytes_per_replica": REPLICA_KV_CACHE_BYTES, "max_num_seqs": 16}
    for name, (num_replicas, threads, routing) in configs.items():
        results[name] = {"num_replicas": num_replicas, "threads_per_replica": threads, "routing": routing,
                         **{f: summarize([run[f] for run in runs[name]]) for f in figures},
                         "requests_per_replica": [run["requests_per_replica"] for run in runs[name]],
                         "load_average_1min": [run["load_average_1min"] for run in runs[name]],
                         "failed": sum(run["failed"] for run in runs[name])}
    return results


SECTIONS = {"allreduce": allreduce, "tensor_parallel": tensor_parallel, "replicas": replicas}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: every other size, 3 repeats")
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--world-size", type=int, default=2, help="processes in the all-reduce (default 2)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="torch.distributed backend: gloo (CPU, default) or nccl (one GPU per rank)")
    add_isa_and_out(parser, "scale_out")
    args = parser.parse_args()
    results = {"quick": args.quick, **{name: SECTIONS[name](args) for name in args.sections}}
    save_result("scale_out", results, out_dir=args.out)


if __name__ == "__main__":
    main()
