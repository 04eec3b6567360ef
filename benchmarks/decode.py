"""Single-stream decode and prefill: minillm against transformers and llama.cpp, each in a process of its own.

    .venv/bin/python benchmarks/decode.py                       # the full run, both code paths (~10 minutes)
    .venv/bin/python benchmarks/decode.py --quick --out /tmp/b  # a smoke run, to /tmp/b/decode.json
    .venv/bin/python benchmarks/decode.py --isa avx2            # one code path only
    .venv/bin/python benchmarks/decode.py --modes fp32,int8     # minillm's activation modes, side by side
    .venv/bin/python benchmarks/decode.py --profile [--isa avx2] [--quick]   # one minillm decode step, op by op

Contenders, all on the same file (SmolLM2-135M-Instruct Q4_1), each in a worker process of its own with
the same threads (``common.py`` says why, and how the workers are driven):
- minillm: ``minillm.LLM(model).generate`` (the engine users run) - once per ``--modes`` entry; a mode
  ``LLM`` rejects is skipped with its message;
- transformers: the GGUF dequantized to fp32, PyTorch eager, a plain loop passing its KV cache along;
- llama.cpp: ``llama_cpp.Llama``, one token per ``eval``.
Every contender decodes greedily from the same token ids and never stops at eos.

The protocol (/work/shared/REFERENCE.md, "Engine benchmark protocol"), per repeat and contender, the
contenders rotating A, B, C, A, B, C ... with a pause between turns, fresh random prompts each repeat
(the same for every contender) so that no prefix cache helps:
- decode tok/s = 127 / (t(128 new tokens) - t(1 new token)), both after a 20-token prompt;
- prefill tok/s = 512 / t(1 new token after a 512-token prompt).
Reported: the median over the repeats and every repeat, per (isa, engine, mode); ratios minillm / each
peer (> 1: minillm is faster); how many greedy tokens each contender shares with minillm fp32; and the
decode ceiling: DRAM read bandwidth / bytes of weights read per token (~96 MB).

Code paths (``--isa``, default both, one after the other): "native" is everything this CPU has
(AVX-512 and VNNI here); "avx2" runs minillm with ``NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=""``, torch with
``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2`` and ``MKL_ENABLE_INSTRUCTIONS=AVX2``, llama.cpp from its AVX2-only build.
Peers (compiled from source, ~9 minutes each): ``benchmarks/build_peers.sh native`` (the same as
``make bench-peers``) and ``benchmarks/build_peers.sh avx2``. A peer that is missing, or a build that
runs other code than asked, is skipped with a message.

Threads: every contender gets min(physical cores, NUMBA_NUM_THREADS). On a busy machine compare one
core each: ``NUMBA_NUM_THREADS=1 .venv/bin/python benchmarks/decode.py``.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from common import (BENCHMARKS, ISA_ENV, LLAMA_CPP, RESULTS, SETTLE_SECONDS, TRANSFORMERS, contender_env,
                    default_threads, interleaved, minillm, random_prompt, ratios, result_name, save_result, start_workers,
                    summarize)

PROMPT_TOKENS = 20


def decode_tokens_per_s(new_tokens: int, one: float, many: float) -> float:
    """The tokens after the first over their time: t(1 new) cancels the prefill and the call's overhead."""
    return (new_tokens - 1) / (many - one)


def prefill_tokens_per_s(prompt_tokens: int, first: float) -> float:
    return prompt_tokens / first


def leading_agreement(a: list[int], b: list[int]) -> int:
    """How many tokens two greedy continuations share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def warm_up(worker, rng: np.random.Generator, prefill_tokens: int) -> None:
    """Compile, page the weights in, wake the thread pools: one short generation, one long prefill."""
    worker.call("generate", prompt=random_prompt(rng, PROMPT_TOKENS), new_tokens=4)
    worker.call("generate", prompt=random_prompt(rng, prefill_tokens), new_tokens=1)


def repeat_prompts(rng: np.random.Generator, prefill_tokens: int, repeats: int) -> list[dict]:
    """Fresh prompts for each repeat (none repeats, so no prefix cache helps): one, many, prefill."""
    return [{kind: random_prompt(rng, length) for kind, length in
             (("one", PROMPT_TOKENS), ("many", PROMPT_TOKENS), ("prefill", prefill_tokens))} for _ in range(repeats)]


def decode_and_prefill(worker, prompts: dict, new_tokens: int, prefill_tokens: int) -> tuple[list[int], float, float]:
    """One repeat of the protocol on one contender -> (its new tokens, decode tok/s, prefill tok/s)."""
    _, one = worker.call("generate", prompt=prompts["one"], new_tokens=1)
    tokens, many = worker.call("generate", prompt=prompts["many"], new_tokens=new_tokens)
    _, first = worker.call("generate", prompt=prompts["prefill"], new_tokens=1)
    if len(tokens) != new_tokens:
        raise RuntimeError(f"{worker.name} generated {len(tokens)} tokens, not {new_tokens}")
    return tokens, decode_tokens_per_s(new_tokens, one, many), prefill_tokens_per_s(prefill_tokens, first)


def run_isa(isa: str, modes: list[str], threads: int, new_tokens: int, prefill_tokens: int, repeats: int) -> dict:
    """One fair run on one code path -> the entries of decode.json and minillm's bytes per token."""
    contenders = [minillm(mode) for mode in modes] + [TRANSFORMERS, LLAMA_CPP]
    workers = {w.name: w for w in start_workers(contenders, isa, threads)}
    print(f"[{isa}] {', '.join(workers)}: {threads} threads; decode: {PROMPT_TOKENS}-token prompt, 1 and "
          f"{new_tokens} new tokens; prefill: {prefill_tokens} tokens; {repeats} repeats, interleaved")
    rng = np.random.default_rng(0)
    for worker in workers.values():
        warm_up(worker, rng, prefill_tokens)
    prompts = repeat_prompts(rng, prefill_tokens, repeats)
    decode, prefill, tokens = {n: [] for n in workers}, {n: [] for n in workers}, {}
    for repeat, name in interleaved(list(workers), repeats):
        time.sleep(SETTLE_SECONDS)
        tokens[name], decode_rate, prefill_rate = decode_and_prefill(workers[name], prompts[repeat], new_tokens,
                                                                     prefill_tokens)
        decode[name].append(decode_rate)
        prefill[name].append(prefill_rate)
        if name == list(workers)[-1]:
            print(f"  repeat {repeat + 1}/{repeats}: decode " + ", ".join(f"{n} {d[-1]:.1f}" for n, d in decode.items())
                  + " tok/s")
    bytes_per_token = next((w.call("weight_bytes_per_token")[0] for n, w in workers.items() if n.startswith("minillm")),
                           None)
    for worker in workers.values():
        worker.close()

    entries = []
    reference = tokens.get("minillm fp32")
    for name, worker in workers.items():
        engine, _, mode = name.partition(" ")
        entries.append({"isa": isa, "engine": engine, "mode": mode or None, "stamp": worker.stamp,
                        "decode_tokens_per_s": summarize(decode[name]),
                        "prefill_tokens_per_s": summarize(prefill[name]),
                        "greedy_tokens_equal_to_minillm_fp32": None if reference is None
                        else leading_agreement(tokens[name], reference)})
    medians = {kind: {name: entry[f"{kind}_tokens_per_s"]["median"] for name, entry in zip(workers, entries)}
               for kind in ("decode", "prefill")}
    for name, entry in zip(workers, entries):
        if entry["engine"] == "minillm":
            entry["ratios"] = {kind: {peer: r for peer, r in ratios(m, name).items() if not peer.startswith("minillm")}
                               for kind, m in medians.items()}
    return {"entries": entries, "weight_bytes_per_token": bytes_per_token}


def print_table(entries: list[dict]) -> None:
    print(f"\n{'isa':<8}{'engine':<14}{'mode':<6}{'decode tok/s':>13}{'prefill tok/s':>15}   ratios minillm / peer "
          f"(decode, prefill)")
    for e in entries:
        ratio = "  ".join(f"{peer} {d:.2f}x, {e['ratios']['prefill'][peer]:.2f}x"
                          for peer, d in e.get("ratios", {}).get("decode", {}).items())
        print(f"{e['isa']:<8}{e['engine']:<14}{e['mode'] or '':<6}{e['decode_tokens_per_s']['median']:>13.1f}"
              f"{e['prefill_tokens_per_s']['median']:>15.1f}   {ratio}")


def dram_read_gbs() -> float:
    """Best read bandwidth over a 512 MiB working set, far past any cache (after every contender has exited)."""
    from minillm.hardware.microbench import MIB, measure_bandwidth

    return measure_bandwidth("read", 512 * MIB, repeats=5).bandwidth_gbs


def side_by_side(args) -> None:
    from minillm.model.fetch import cached_model_path, fetch

    model = cached_model_path() or fetch()
    threads = default_threads()
    new_tokens, prefill_tokens, repeats = (32, 128, 3) if args.quick else (128, 512, 5)
    entries, bytes_per_token = [], None
    for isa in args.isa:
        run = run_isa(isa, args.modes, threads, new_tokens, prefill_tokens, repeats)
        entries += run["entries"]
        bytes_per_token = bytes_per_token or run["weight_bytes_per_token"]
    print_table(entries)
    results = {"quick": args.quick, "model": model.name, "threads": threads, "repeats": repeats,
               "protocol": {"decode": f"{new_tokens - 1} / (t({new_tokens} new) - t(1 new)) after a "
                                      f"{PROMPT_TOKENS}-token prompt",
                            "prefill": f"{prefill_tokens} / t(1 new after a {prefill_tokens}-token prompt)",
                            "prompts": "random token ids, fresh each repeat, the same for every contender"},
               "entries": entries}
    if bytes_per_token:
        bandwidth = dram_read_gbs()
        results |= {"weight_bytes_per_token": bytes_per_token, "dram_read_gbs": bandwidth,
                    "decode_ceiling_tokens_per_s": bandwidth * 1e9 / bytes_per_token}
        print(f"decode ceiling: {bandwidth:.1f} GB/s DRAM read / {bytes_per_token / 1e6:.1f} MB per token "
              f"= {results['decode_ceiling_tokens_per_s']:.0f} tok/s")
    save_result("decode", results, args.out)


def profile(args) -> None:
    """decode_profile.py in a process set up as minillm's contender is (threads, code path); one file per
    code path and mode: decode_profile.json (native, fp32), decode_profile_avx2.json, decode_profile_int8.json,
    decode_profile_avx2_int8.json."""
    for isa in args.isa:
        for mode in args.modes:
            command = [sys.executable, str(BENCHMARKS / "decode_profile.py"), "--out", str(args.out),
                       "--name", result_name("decode_profile", isa, mode),
                       "--activations", mode, *(["--quick"] if args.quick else [])]
            subprocess.run(command, env=contender_env(isa, default_threads()), check=True)


def comma_list(choices=None):
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        unknown = [item for item in items if choices is not None and item not in choices]
        if not items or unknown:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(choices or ['names'])}; "
                                             f"got {text!r}")
        return items
    return parse


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 32 new tokens, 128-token prefill, 3 repeats")
    parser.add_argument("--isa", type=comma_list(ISA_ENV), default=["native", "avx2"],
                        help="code paths, one fair run each (default: native,avx2)")
    parser.add_argument("--modes", type=comma_list(), default=["fp32"],
                        help="minillm activation modes, e.g. fp32,int8 (default: fp32)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for decode.json (default: benchmarks/results)")
    parser.add_argument("--profile", action="store_true", help="time each operator family of a minillm decode step")
    args = parser.parse_args()
    if args.profile:
        profile(args)
    else:
        side_by_side(args)


if __name__ == "__main__":
    main()
