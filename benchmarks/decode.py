"""Single-stream decode and prefill: minillm against transformers and llama.cpp, one GGUF file, one run.

    .venv/bin/python benchmarks/decode.py             # the full run (several minutes)
    .venv/bin/python benchmarks/decode.py --quick     # a smoke run: fewer tokens and repetitions
    .venv/bin/python benchmarks/decode.py --profile   # where one minillm decode step spends its time

Contenders, all on the same file (SmolLM2-135M-Instruct Q4_1) with the same threads (physical cores):
- minillm: ``Generation`` (the chapter 06 loop: packed Q4_1/Q8_0 weights, Numba kernels);
- transformers: ``AutoModelForCausalLM`` loaded from the GGUF (dequantized to fp32), PyTorch eager,
  ``torch.set_num_threads(cores)``, a plain loop passing its KV ``cache`` along, with ``logits_to_keep=1``;
- llama.cpp: ``llama_cpp.Llama`` (its own quantized kernels), ``eval`` one token at a time.
Every contender decodes greedily from the same token ids and never stops at eos, so each produces
exactly the same number of tokens.

Two measurements, interleaved (A, B, C, A, B, C, ...) so that a noisy moment hurts all alike:
- decode: a 20-token prompt, 128 new tokens; tokens/s = 127 / (time from the first token to the
  last), i.e. 1 / TPOT;
- prefill: a 512-token prompt, one new token; tokens/s = 512 / time to first token.
Reported: medians over the repetitions, the ratios minillm / transformers and minillm / llama.cpp
(> 1: minillm is faster), and the bandwidth ceiling of decode on this machine: measured DRAM read
bandwidth / bytes of weights read per token (~96 MB). Results: benchmarks/results/decode.json.
A peer that is not installed is skipped with a message (llama.cpp: ``make bench-peers``).

Threads: every contender gets min(physical cores, NUMBA_NUM_THREADS). On a busy machine, where a
thread that waits at a barrier may not get its core back for milliseconds, compare one core each:
``NUMBA_NUM_THREADS=1 .venv/bin/python benchmarks/decode.py``.

``--profile`` runs decode steps on a model built from the same weights with a timing proxy around
every kernel op (no kernel is edited), and splits the step into operator families: the quantized
matvecs by weight kind, the LM head, attention, RMSNorm, RoPE, SwiGLU, the KV-cache write, sampling
and the rest (Python glue). Results: benchmarks/results/decode_profile.json.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import numba
import numpy as np
from common import load_transformers_model, save_result

from minillm.generation.generate import Generation, decode_step, prefill
from minillm.generation.sampling import Sampler, SamplingParams, SamplingState
from minillm.generation.tokenizer import Tokenizer
from minillm.hardware.machine import describe_machine
from minillm.hardware.microbench import MIB, measure_bandwidth
from minillm.kernels.registry import OPS, Backend
from minillm.model.fetch import cached_model_path, fetch
from minillm.model.loader import load_model
from minillm.model.transformer import Model

SETTLE_SECONDS = 0.5  # between contenders: PyTorch's and llama.cpp's threads spin for a while after a call
TEXT = ("The history of computing is a story of machines that got faster by moving data less. Early "
        "computers read every operand from slow memory; caches, pipelines and vector units followed. "
        "Large language models bring the question back: to write one word, a model reads all of its "
        "weights once, so the speed of memory, not of arithmetic, sets the pace. ")


# -----------------------------------------------------------------------------------------------
# The contenders: decode(prompt, n) -> (token ids, seconds per token after the first);
# prefill(prompt) -> seconds to the first token

class Minillm:
    name = "minillm"

    def __init__(self, path, threads):
        numba.set_num_threads(threads)
        self.model, self.tokenizer = load_model(path), Tokenizer.from_gguf(path)

    def _generate(self, prompt, n):
        g = Generation(self.model, self.tokenizer, prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                                                           ignore_eos=True))
        return g.run().token_ids, g.timings()

    def decode(self, prompt, n):
        ids, timings = self._generate(prompt, n)
        return ids, timings.tpot_s

    def prefill(self, prompt):
        return self._generate(prompt, 1)[1].ttft_s


class Transformers:
    name = "transformers"

    def __init__(self, path, threads):
        self.torch, self.model = load_transformers_model(path, threads)

    def _first(self, prompt):
        out = self.model(self.torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        return out, out.logits[0, -1].argmax()

    def decode(self, prompt, n):
        with self.torch.inference_mode():
            out, token = self._first(prompt)
            ids, first = [int(token)], time.perf_counter()
            for _ in range(n - 1):
                out = self.model(token.view(1, 1), cache=out.cache, use_cache=True)
                token = out.logits[0, -1].argmax()
                ids.append(int(token))
            return ids, (time.perf_counter() - first) / (n - 1)

    def prefill(self, prompt):
        with self.torch.inference_mode():
            start = time.perf_counter()
            self._first(prompt)
            return time.perf_counter() - start


class LlamaCpp:
    name = "llama.cpp"

    def __init__(self, path, threads):
        import llama_cpp

        self.llama_cpp = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=2048,
                                   verbose=False)

    def _next(self, tokens):
        """Evaluate tokens after what the context holds; the argmax of the last one's logits.

        ``Llama.eval`` keeps no logits unless built with logits_all (which would compute the LM head
        for every prompt token): read the last row straight from the llama.cpp context.
        """
        self.llm.eval(tokens)
        last = self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(last, shape=(self.llm.n_vocab(),))))

    def decode(self, prompt, n):
        self.llm.reset()  # forget the previous sequence; eval overwrites its KV entries
        ids = [self._next(prompt)]
        first = time.perf_counter()
        for _ in range(n - 1):
            ids.append(self._next([ids[-1]]))
        return ids, (time.perf_counter() - first) / (n - 1)

    def prefill(self, prompt):
        self.llm.reset()
        start = time.perf_counter()
        self._next(prompt)
        return time.perf_counter() - start


CONTENDERS = (Minillm, Transformers, LlamaCpp)


def load_contenders(path, threads):
    """Every contender that loads; a missing peer is skipped with a message."""
    loaded = []
    for cls in CONTENDERS:
        try:
            loaded.append(cls(path, threads))
        except ImportError as err:
            print(f"skipping {cls.name}: {err} (install the peers with `make bench-peers`)")
    return loaded


# -----------------------------------------------------------------------------------------------
# Prompts and the bandwidth ceiling

def prompt_ids(tokenizer: Tokenizer, n: int) -> list[int]:
    """The first n tokens of TEXT, repeated as often as needed."""
    ids = tokenizer.encode(TEXT)
    return (ids * (n // len(ids) + 1))[:n]


def weight_bytes_per_token(model: Model) -> int:
    """Bytes of weights a decode step reads: every layer, the final norm and the LM head (the embedding
    lookup reads one row only). Packed bytes for quantized weights."""
    w = model.weights
    arrays = [w.final_norm, w.lm_head, *(a for layer in w.layers for a in vars(layer).values() if a is not None)]
    return sum(a.nbytes for a in arrays)


def dram_read_gbs() -> float:
    """Best read bandwidth over a 512 MiB working set, far past any cache (minillm.hardware.microbench)."""
    return measure_bandwidth("read", 512 * MIB, repeats=5).bandwidth_gbs


# -----------------------------------------------------------------------------------------------
# The side-by-side run

def leading_agreement(a: list[int], b: list[int]) -> int:
    """How many tokens two greedy continuations share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def side_by_side(args) -> None:
    path = cached_model_path() or fetch()
    cores = min(describe_machine().cores, numba.config.NUMBA_NUM_THREADS)
    contenders = load_contenders(path, cores)
    minillm = contenders[0]
    n_new, prefill_len, reps = (32, 128, 2) if args.quick else (128, 512, 5)
    short, long = prompt_ids(minillm.tokenizer, 20), prompt_ids(minillm.tokenizer, prefill_len)
    print(f"{', '.join(c.name for c in contenders)} on {path.name}, {cores} threads; decode: 20-token prompt, "
          f"{n_new} new tokens; prefill: {prefill_len} tokens; {reps} repetitions, interleaved")

    for c in contenders:  # warm-up: compile, page the weights in, wake the thread pools
        c.decode(short, 4)
        c.prefill(long)
    decode_s, prefill_s, tokens = defaultdict(list), defaultdict(list), {}
    for rep in range(reps):
        for c in contenders:
            time.sleep(SETTLE_SECONDS)
            tokens[c.name], seconds = c.decode(short, n_new)
            if len(tokens[c.name]) != n_new:
                raise RuntimeError(f"{c.name} generated {len(tokens[c.name])} tokens, not {n_new}")
            decode_s[c.name].append(seconds)
        for c in contenders:
            time.sleep(SETTLE_SECONDS)
            prefill_s[c.name].append(c.prefill(long))
        print(f"  repetition {rep + 1}/{reps}: decode " + ", ".join(
            f"{name} {1 / s[-1]:.1f}" for name, s in decode_s.items()) + " tok/s")

    bytes_per_token = weight_bytes_per_token(minillm.model)
    bandwidth = dram_read_gbs()
    results = {"quick": args.quick, "model": path.name, "threads": cores, "repetitions": reps,
               "decode": {"prompt_tokens": 20, "new_tokens": n_new}, "prefill": {"prompt_tokens": prefill_len},
               "weight_bytes_per_token": bytes_per_token, "dram_read_gbs": bandwidth,
               "decode_ceiling_tokens_per_s": bandwidth * 1e9 / bytes_per_token, "engines": {}}
    for c in contenders:
        results["engines"][c.name] = {
            "decode_tokens_per_s": statistics.median(1 / s for s in decode_s[c.name]),
            "prefill_tokens_per_s": statistics.median(prefill_len / s for s in prefill_s[c.name]),
            "decode_tokens_per_s_all": [1 / s for s in decode_s[c.name]],
            "prefill_tokens_per_s_all": [prefill_len / s for s in prefill_s[c.name]],
            "greedy_tokens_equal_to_minillm": leading_agreement(tokens[c.name], tokens["minillm"]),
        }
    ours = results["engines"]["minillm"]
    for name, peer in results["engines"].items():
        if name != "minillm":
            for kind in ("decode", "prefill"):
                key = f"{kind}_tokens_per_s"
                results[f"{kind}_ratio_minillm_over_{name}"] = ours[key] / peer[key]

    print(f"\n{'engine':<14}{'decode tok/s':>14}{'prefill tok/s':>15}{'minillm / it (decode, prefill)':>34}"
          f"{'same greedy tokens':>20}")
    for name, r in results["engines"].items():
        ratio = (f"{ours['decode_tokens_per_s'] / r['decode_tokens_per_s']:.2f}x, "
                 f"{ours['prefill_tokens_per_s'] / r['prefill_tokens_per_s']:.2f}x") if name != "minillm" else ""
        print(f"{name:<14}{r['decode_tokens_per_s']:>14.1f}{r['prefill_tokens_per_s']:>15.1f}{ratio:>34}"
              f"{r['greedy_tokens_equal_to_minillm']:>13}/{n_new}")
    print(f"decode ceiling: {bandwidth:.1f} GB/s DRAM read / {bytes_per_token / 1e6:.1f} MB per token "
          f"= {results['decode_ceiling_tokens_per_s']:.0f} tok/s; minillm reaches "
          f"{ours['decode_tokens_per_s'] / results['decode_ceiling_tokens_per_s']:.0%} of it")
    save_result("decode", results)


# -----------------------------------------------------------------------------------------------
# --profile: one decode step, operator by operator

def weight_kinds(model: Model) -> dict[int, str]:
    """id(weight) -> the family its matvec is counted in."""
    kinds = {id(model.weights.lm_head): "LM head"}
    names = {"wq": "qkv proj", "wk": "qkv proj", "wv": "qkv proj", "wo": "attn output proj",
             "w_gate": "ffn gate/up", "w_up": "ffn gate/up", "w_down": "ffn down"}
    for layer in model.weights.layers:
        for field, kind in names.items():
            kinds[id(getattr(layer, field))] = kind
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


def profile(args) -> None:
    path = cached_model_path() or fetch()
    numba.set_num_threads(min(describe_machine().cores, numba.config.NUMBA_NUM_THREADS))
    model, tokenizer = load_model(path), Tokenizer.from_gguf(path)
    steps = 16 if args.quick else 64
    prompt = prompt_ids(tokenizer, 20)
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
    print(f"one decode step of {model} at positions {len(prompt)}..{len(prompt) + steps - 1}: {step * 1e3:.2f} ms "
          f"instrumented, {plain * 1e3:.2f} ms plain (median of 3 runs of {steps} steps)")
    print(f"{'family':<22}{'ms/step':>9}{'share':>8}")
    for family, s in sorted(per_step.items(), key=lambda kv: -kv[1]):
        print(f"{family:<22}{s * 1e3:>9.3f}{s / step:>8.1%}")
    save_result("decode_profile", {"quick": args.quick, "model": path.name, "steps": steps,
                                   "threads": numba.get_num_threads(), "sampling": "temperature 0.8, top_p 0.95",
                                   "step_ms_instrumented": step * 1e3, "step_ms_plain": plain * 1e3,
                                   "ms_per_step": {f: s * 1e3 for f, s in per_step.items()}})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer tokens and repetitions")
    parser.add_argument("--profile", action="store_true", help="time each operator family of a minillm decode step")
    args = parser.parse_args()
    if args.profile:
        profile(args)
    else:
        side_by_side(args)


if __name__ == "__main__":
    main()
