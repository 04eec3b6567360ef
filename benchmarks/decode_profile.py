"""Where one minillm decode step spends its time, operator family by operator family.

    .venv/bin/python benchmarks/decode.py --profile [--isa avx2] [--quick] [--out DIR]   # the usual way
    .venv/bin/python benchmarks/decode_profile.py [--quick] [--out DIR]                   # this process as it is

``decode.py --profile`` runs this file in a process set up as minillm's contender is (threads, and
the AVX2 code path for ``--isa avx2``). The profiler is the package's
(``minillm.generation.profile.profile_decode``, which chapter 06 runs too): decode steps on the same
weights with a timer around every kernel op (no kernel is edited), split into operator families -
the quantized matvecs by weight kind, the LM head, attention, RMSNorm, RoPE, SwiGLU, the KV-cache
write, sampling and the rest (Python glue), and for each weight family the bandwidth it achieved
(its bytes over its time) beside the machine's DRAM read bandwidth. This script picks the workload
and stamps the result:
benchmarks/results/decode_profile.json (decode_profile_avx2.json for ``--isa avx2``; _int8 added to
either name for ``--modes int8``, the int8 activation mode).

A timer around every op keeps the per-op path (the fused decode layer runs only the backend's own
kernels, minillm/kernels/cpu/fused_decode.py), so the op-by-op profile is not the step users get.
``engine_step`` times that one: the engine (scheduler, paged cache, sampler) decoding one request,
each step split into the fused decoder layers, the checks that set them up, the embedding, the LM
head, sampling, and what is left: the Python outside every kernel (and the final RMSNorm of one
row, which cannot be timed without leaving the fused path: a timed op is not the backend's own).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time
from pathlib import Path

import numba
import numpy as np
from common import RESULTS, numba_target, random_prompt, save_result, seconds_per_call

from minillm.generation.profile import profile_decode
from minillm.generation.sampling import SamplingParams
from minillm.hardware.microbench import MIB, measure_bandwidth
from minillm.llm import load_tokenizer
from minillm.model.fetch import cached_model_path, fetch
from minillm.model.loader import load_model
from minillm.model.profile import OpTimer, weight_bytes_by_family
from minillm.runtime.engine import LLMEngine

OUTSIDE = "rest (Python, final norm)"
PACKING = "batch packing"


def timed_engine_model(model, timer: OpTimer):
    """A shallow copy of ``model`` (the same weights) whose forward's parts are timed: the fused step's
    checks, the fused layers' call, the embedding, the LM head."""
    timed = copy.copy(model)
    fused_decode_step = timer.wrap("fused step checks", model.fused_decode_step)

    def fused_step_with_timed_layers(*args):
        fused = fused_decode_step(*args)
        if fused is not None:
            step, layers = fused
            step.run = timer.wrap("decoder layers (fused)", step.run)
        return fused

    timed.fused_decode_step = fused_step_with_timed_layers
    timed.embed = timer.wrap("embedding", model.embed)
    timed.lm_head = timer.wrap("LM head", model.lm_head)
    return timed


def engine_step(model, tokenizer, prompt: list[int], steps: int, params: SamplingParams, repeats: int = 3) -> dict:
    """ms a decode step of the engine (one request, the step users get), plain (median of
    ``repeats`` runs) and split by a timed run; the steps must run fused."""
    params = dataclasses.replace(params, ignore_eos=True)  # every run takes all its steps

    def run(engine_model, timer: OpTimer | None):
        engine = LLMEngine(engine_model, tokenizer, max_num_seqs=1)
        if timer is not None:
            engine.runner.sampler.sample = timer.wrap("sampling", engine.runner.sampler.sample)
            engine.runner.prepare = timer.wrap(PACKING, engine.runner.prepare)
        engine.add_request(prompt, params)
        engine.step()  # the prefill (and the first token): not profiled
        if timer is not None:
            timer.clear()
        fused_before, start = engine_model.fused_decode_steps, time.perf_counter()
        taken = 0
        while engine.has_unfinished():
            engine.step()
            taken += 1
        seconds = time.perf_counter() - start
        fused = engine_model.fused_decode_steps - fused_before
        if taken != steps - 1 or fused != taken:
            raise RuntimeError(f"{taken} decode steps, {fused} fused: "
                               f"the engine's steps must all run the fused layers")
        return 1e3 * seconds / taken, taken

    run(model, None)  # warm-up: every kernel compiled
    plain = statistics.median(run(model, None)[0] for _ in range(repeats))
    timer = OpTimer(model)
    timed = timed_engine_model(model, timer)
    step_ms, taken = run(timed, timer)
    ms = {family: 1e3 * s / taken for family, s in timer.seconds.items()}
    ms[OUTSIDE] = step_ms - sum(ms.values())
    return {"step_ms_plain": plain, "step_ms_timed": step_ms, "ms_per_step": ms,
            "outside_kernels_share": (ms[OUTSIDE] + ms["fused step checks"] + ms[PACKING]) / step_ms,
            "glue_us_warm": glue_when_warm(model, tokenizer, prompt, params)}


def glue_when_warm(model, tokenizer, prompt: list[int], params: SamplingParams) -> dict:
    """us of the step's batch packing and the fused step's checks, each called back to back on one
    decode step's inputs (median of 20 samples): the same Python as in a step, but with the caches warm. In a
    step it runs after the layers and the LM head have streamed ~100 MB of weights through them."""
    engine = LLMEngine(model, tokenizer, max_num_seqs=1)
    engine.add_request(prompt, dataclasses.replace(params, max_tokens=3))
    engine.step()  # the prefill
    seen = {}
    prepare, fused_decode_step = engine.runner.prepare, model.fused_decode_step

    def keep(name, fn):
        def kept(*args):
            seen[name] = args
            return fn(*args)
        return kept
    engine.runner.prepare = keep(PACKING, prepare)
    engine.runner.model = copy.copy(model)
    engine.runner.model.fused_decode_step = keep("fused step checks", fused_decode_step)
    engine.step()  # one decode step: its inputs kept

    def us(fn, args):
        return 1e6 * statistics.median(seconds_per_call(lambda: fn(*args), samples=20, sample_seconds=5e-3))
    return {PACKING: us(prepare, seen[PACKING]), "fused step checks": us(fused_decode_step, seen["fused step checks"])}


def profile(quick: bool, out_dir: Path, name: str, activations: str) -> None:
    path = cached_model_path() or fetch()
    model = load_model(path, activations=activations)
    steps = 16 if quick else 64
    prompt = random_prompt(np.random.default_rng(0), 20)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=steps)  # a usual chat setting
    p = profile_decode(model, prompt, steps, params)
    target = numba_target()
    print(f"one decode step of {model} ({target['isa']} code for {target['cpu_name']}, {numba.get_num_threads()} "
          f"threads) at positions {p.first_position}..{p.first_position + steps - 1}: "
          f"{p.step_ms_instrumented:.2f} ms instrumented, {p.step_ms_plain:.2f} ms plain "
          f"(median of 3 runs of {steps} steps)")
    # Each weight family is read once a step: its bytes over its time is the bandwidth it achieved,
    # to hold against the machine's DRAM read bandwidth (the roof of a memory-bound matvec).
    weight_bytes = weight_bytes_by_family(model)
    gbs = {family: weight_bytes[family] / (p.ms_per_step[family] * 1e6) for family in weight_bytes}
    dram_gbs = measure_bandwidth("read", 512 * MIB, repeats=5).bandwidth_gbs  # far past any cache
    print(f"{'family':<22}{'ms/step':>9}{'share':>8}{'MB/step':>9}{'GB/s':>7}")
    for family, ms in sorted(p.ms_per_step.items(), key=lambda kv: -kv[1]):
        weights = f"{weight_bytes[family] / 1e6:>9.2f}{gbs[family]:>7.1f}" if family in gbs else ""
        print(f"{family:<22}{ms:>9.3f}{ms / p.step_ms_instrumented:>8.1%}{weights}")
    print(f"DRAM read bandwidth (512 MiB, best of 5): {dram_gbs:.1f} GB/s")
    engine = engine_step(model, load_tokenizer(path), prompt, steps, params)
    print(f"the engine's decode step (fused layers, paged cache, sampler): {engine['step_ms_plain']:.2f} ms plain, "
          f"{engine['step_ms_timed']:.2f} ms timed")
    for family, ms in engine["ms_per_step"].items():
        print(f"{family:<28}{ms:>9.3f}{ms / engine['step_ms_timed']:>8.1%}")
    print("the same glue called back to back, caches warm: " + ", ".join(
        f"{family} {us:.0f} us (in the step {1e3 * engine['ms_per_step'][family]:.0f} us)"
        for family, us in engine["glue_us_warm"].items()))
    save_result(name, {"quick": quick, "model": path.name, "steps": steps, "isa": target["isa"], "activations": activations,
                       "threads": numba.get_num_threads(), "sampling": "temperature 0.8, top_p 0.95",
                       "step_ms_instrumented": p.step_ms_instrumented, "step_ms_plain": p.step_ms_plain,
                       "ms_per_step": p.ms_per_step, "weight_bytes_per_step": weight_bytes,
                       "weight_gbs": gbs, "dram_read_gbs": dram_gbs, "engine_step": engine}, out_dir)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 decode steps instead of 64")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the result file")
    parser.add_argument("--name", default="decode_profile", help="the result file's name, without .json")
    parser.add_argument("--activations", choices=("fp32", "int8"), default="fp32", help="minillm's activation mode")
    args = parser.parse_args()
    profile(args.quick, args.out, args.name, args.activations)


if __name__ == "__main__":
    main()
