"""Where one minillm decode step spends its time, operator family by operator family.

    .venv/bin/python benchmarks/decode.py --profile [--isa avx2] [--quick] [--out DIR]   # the usual way
    .venv/bin/python benchmarks/decode_profile.py [--quick] [--out DIR]                   # this process as it is

``decode.py --profile`` runs this file in a process set up as minillm's contender is (threads, and
the AVX2 code path for ``--isa avx2``). It runs decode steps on a model built from the same weights
with a timing proxy around every kernel op (no kernel is edited), and splits the step into operator
families: the quantized matvecs by weight kind, the LM head, attention, RMSNorm, RoPE, SwiGLU, the
KV-cache write, sampling and the rest (Python glue). Results: benchmarks/results/decode_profile.json
(decode_profile_avx2.json for ``--isa avx2``).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

import numba
import numpy as np
from common import RESULTS, numba_target, random_prompt, save_result

from minillm.generation.generate import decode_step, prefill
from minillm.generation.sampling import Sampler, SamplingParams, SamplingState
from minillm.kernels.registry import OPS, Backend
from minillm.model.fetch import cached_model_path, fetch
from minillm.model.loader import load_model
from minillm.model.transformer import Model


def weight_kinds(model: Model) -> dict[int, str]:
    """id(weight) -> the family its matvec is counted in."""
    kinds = {id(model.weights.lm_head): "LM head"}
    names = {"wq": "qkv proj", "wk": "qkv proj", "wv": "qkv proj", "wo": "attn output proj",
             "w_gate": "ffn gate/up", "w_up": "ffn gate/up", "w_down": "ffn down"}
    for layer in model.weights.layers:
        for field, kind in names.items():
            kinds[id(getattr(layer, field))] = kind
        kinds.update({id(w): "qkv proj" for w in layer.qkv} | {id(w): "ffn gate/up" for w in layer.gate_up})  # stacked
    return kinds


class OpTimer:
    """Seconds per operator family, accumulated by wrappers around a backend's ops."""

    FAMILIES = {"rms_norm": "rms_norm", "rope": "rope", "swiglu": "swiglu", "silu": "swiglu",
                "attention": "attention", "attention_decode": "attention", "softmax": "attention",
                "embedding": "embedding", "qembedding": "embedding", "matmul": "matmul"}

    def __init__(self, model: Model):
        self.kinds = weight_kinds(model)
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, op: str, fn):
        def timed(*args):
            start = time.perf_counter()
            out = fn(*args)
            self.seconds[self.family(op, args)] += time.perf_counter() - start
            return out
        return timed

    def family(self, op: str, args) -> str:
        if op in ("linear", "qlinear"):  # args = (x, weight): which weight it is names the family
            return self.kinds.get(id(args[1]), "other linear")
        return self.FAMILIES.get(op, op)

    def backend(self, ops: Backend) -> Backend:
        """A backend whose every op is ``ops``' op, timed (rope_table too: it runs once, at build)."""
        return Backend(f"timed {ops.name}", {op: self.wrap(op, getattr(ops, op)) for op in OPS})


def profile(quick: bool, out_dir: Path, name: str) -> None:
    path = cached_model_path() or fetch()
    model = load_model(path)
    steps = 16 if quick else 64
    prompt = random_prompt(np.random.default_rng(0), 20)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=steps)  # a usual chat setting
    timer = OpTimer(model)
    timed_model = Model(model.config, model.weights, timer.backend(model.ops))

    def run(m: Model, measured: bool) -> float:
        """Seconds per decode step of `steps` steps after a prefill (sampling included)."""
        cache = m.new_cache(n_slots=1, max_len=len(prompt) + steps + 1)
        if measured:
            cache.write = timer.wrap("kv-cache write", cache.write)
        sampler, state = Sampler(), SamplingState(params, prompt)
        token = int(np.argmax(prefill(m, cache, prompt)))
        timer.seconds.clear()
        start = time.perf_counter()
        for position in range(len(prompt), len(prompt) + steps):
            logits = decode_step(m, cache, token, position)                 # (V,)
            t = time.perf_counter()
            token = int(sampler.sample(logits[None], [state]).token_ids[0])
            timer.seconds["sampling"] += time.perf_counter() - t
            state.output_ids.append(token)
        return (time.perf_counter() - start) / steps

    run(model, measured=False)                        # warm-up: compile every kernel
    plain = statistics.median(run(model, measured=False) for _ in range(3))
    step = run(timed_model, measured=True)
    per_step = {family: s / steps for family, s in timer.seconds.items()}
    per_step["other (Python glue)"] = step - sum(per_step.values())
    target = numba_target()
    print(f"one decode step of {model} ({target['isa']} code for {target['cpu_name']}, {numba.get_num_threads()} "
          f"threads) at positions {len(prompt)}..{len(prompt) + steps - 1}: {step * 1e3:.2f} ms instrumented, "
          f"{plain * 1e3:.2f} ms plain (median of 3 runs of {steps} steps)")
    print(f"{'family':<22}{'ms/step':>9}{'share':>8}")
    for family, s in sorted(per_step.items(), key=lambda kv: -kv[1]):
        print(f"{family:<22}{s * 1e3:>9.3f}{s / step:>8.1%}")
    save_result(name, {"quick": quick, "model": path.name, "steps": steps, "isa": target["isa"],
                                   "threads": numba.get_num_threads(), "sampling": "temperature 0.8, top_p 0.95",
                                   "step_ms_instrumented": step * 1e3, "step_ms_plain": plain * 1e3,
                                   "ms_per_step": {f: s * 1e3 for f, s in per_step.items()}}, out_dir)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 decode steps instead of 64")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the result file")
    parser.add_argument("--name", default="decode_profile", help="the result file's name, without .json")
    args = parser.parse_args()
    profile(args.quick, args.out, args.name)


if __name__ == "__main__":
    main()
