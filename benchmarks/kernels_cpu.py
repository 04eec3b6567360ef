"""Chapter 02's kernels side by side with NumPy and PyTorch, at SmolLM2-135M shapes.

    .venv/bin/python benchmarks/kernels_cpu.py            # the full run (a few minutes)
    .venv/bin/python benchmarks/kernels_cpu.py --quick    # a smoke run (fewer repetitions, smaller shapes)

Each implementation runs in a worker process of its own (benchmarks/common.py: thread pools that
spin after a call - Numba's, OpenBLAS's, PyTorch's - must not share a process), every process
building the same inputs from the same seed. For every case the three take turns (ours, numpy,
torch, ours, ...; TURNS times) so that a noisy neighbour hurts all of them alike; a turn takes
`samples` samples, each repeating a call until it lasts ~1 ms, and reports their median; the median
of the turns is reported with the bandwidth and FLOP/s it achieves and the speed ratios (> 1: ours is
faster). "numpy" is the NumPy
specification (minillm.kernels.reference) or plain NumPy/BLAS; "torch" is PyTorch eager on all
cores. Decode-shaped linear layers cycle through enough weight copies to overflow the L3
cache, as a real model's 30 layers do. Results: benchmarks/results/kernels_cpu.json.

Threads: min(physical cores, NUMBA_NUM_THREADS) for all three. On a busy machine compare one core
each, where a descheduled helper thread cannot stall a call:

    NUMBA_NUM_THREADS=1 .venv/bin/python benchmarks/kernels_cpu.py --quick

``--isa avx2`` runs all three on the AVX2 code path (see decode.py); ``--out DIR`` writes elsewhere.
"""
from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from common import (Contender, add_isa_and_out, default_threads, save_result, seconds_per_call, start_all,
                    take_turns)
from transformers.models.llama.modeling_llama import rotate_half

from minillm.kernels import cpu, reference
from minillm.model.config import ModelConfig
from minillm.model.fetch import cached_model_path, fetch

# The shapes of the default model (SmolLM2-135M), read from its file
CONFIG = ModelConfig.from_gguf(cached_model_path() or fetch())
D, FFN, H, HKV, DH = CONFIG.hidden_size, CONFIG.intermediate_size, CONFIG.n_heads, CONFIG.n_kv_heads, CONFIG.head_dim
VOCAB, EPS, THETA = CONFIG.vocab_size, CONFIG.rms_eps, CONFIG.rope_theta
L3_BYTES = 32 << 20
TURNS = 3
SIDES = ("ours", "numpy", "torch")


@dataclass
class Case:
    op: str
    shape: str
    impls: dict      # side -> a call of no arguments
    nbytes: float
    flops: float
    samples_scale: float = 1.0  # the slowest rung of the ladder takes fewer samples


def cases(quick: bool) -> Iterator[Case]:
    """Every case, inputs drawn from one seeded generator: each process builds the same ones, one at a
    time. Measure each case as it is yielded: its calls read the builder's loop variables, which the
    next case reassigns."""
    rng = np.random.default_rng(0)
    if quick:
        prefill_t, contexts, prefill_contexts, ladder_m = 128, (128, 1024), (128,), 128
    else:
        prefill_t, contexts, prefill_contexts, ladder_m = 512, (128, 1024, 4096), (128, 1024, 4096), 512
    yield from fused_ops(rng, prefill_t)
    yield from attention_ops(rng, contexts, prefill_contexts)
    yield from linear_ops(rng, prefill_t)
    yield from matmul_ladder(rng, ladder_m)


class Kernels:
    """One implementation (a side: ours, numpy or torch) of every case, in a process of its own."""

    def __init__(self, threads: int, side: str, samples: int, quick: bool):
        import numba

        numba.set_num_threads(threads)
        torch.set_num_threads(threads)
        self.side, self.samples, self.cases = side, samples, enumerate(cases(quick))
        self.position, self.case = -1, None

    def stamp(self) -> dict:
        import numba
        from common import numba_target

        if self.side == "torch":
            capability = torch.backends.cpu.get_cpu_capability()
            return {"isa": capability.lower(), "cpu_capability": capability, "torch_threads": torch.get_num_threads()}
        target = numba_target()
        return {"isa": target["isa"], "numba_target": target, "numba_threads": numba.get_num_threads()}

    def measure(self, index: int) -> dict[str, float]:
        """{side: median seconds per call} of this side's implementation of case `index` ({}: it has none)."""
        while self.position < index:  # each case once, in order; its turns ask for it again
            self.position, self.case = next(self.cases)
        if self.position != index:
            raise RuntimeError(f"cases are measured in order: asked for {index}, past it at {self.position}")
        case = self.case
        fn = case.impls.get(self.side)
        if fn is None:
            return {}
        return {self.side: statistics.median(seconds_per_call(fn, max(3, int(self.samples * case.samples_scale))))}


def row(case: Case, seconds: dict[str, float]) -> dict:
    out = {"op": case.op, "shape": case.shape, "bytes": case.nbytes, "flops": case.flops, "impls": {}}
    for name, s in seconds.items():
        out["impls"][name] = {"median_s": s, "GB_s": case.nbytes / s / 1e9, "GFLOP_s": case.flops / s / 1e9}
    ours = seconds["ours"]
    out["speedup"] = {f"vs_{name}": s / ours for name, s in seconds.items() if name != "ours"}
    rates = "  ".join(f"{n} {v['median_s'] * 1e6:9.1f} us" for n, v in out["impls"].items())
    ratios = "  ".join(f"{k} {v:5.2f}x" for k, v in out["speedup"].items())
    main = (f"{case.flops / ours / 1e9:7.1f} GFLOP/s" if case.flops > 2 * case.nbytes
            else f"{case.nbytes / ours / 1e9:7.1f} GB/s")
    print(f"{case.op:18s} {case.shape:28s} {rates}  | ours {main} | {ratios}")
    return out


def rand(rng, *shape, scale=1.0) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)


# -----------------------------------------------------------------------------
# the cases


def fused_ops(rng, prefill_t: int) -> Iterator[Case]:
    w_norm = rand(rng, D)
    tw = torch.from_numpy(w_norm)
    cos, sin = reference.rope_table(DH, 8192, THETA)
    for label, T in (("decode", 1), ("prefill", prefill_t)):
        x = rand(rng, T, D)
        tx = torch.from_numpy(x)
        yield Case("rms_norm", f"{label} ({T}, {D})", {
            "ours": lambda: cpu.rms_norm(x, w_norm, EPS),
            "numpy": lambda: reference.rms_norm(x, w_norm, EPS),
            "torch": lambda: F.rms_norm(tx, (D,), tw, EPS),
        }, (2 * T * D + D) * 4, 4 * T * D)

        q = rand(rng, T, H, DH)
        positions = np.arange(100, 100 + T)
        tq, tpos = torch.from_numpy(q.copy()), torch.from_numpy(positions)          # (T, H, Dh), (T,)
        tcos = torch.from_numpy(np.concatenate([cos, cos], -1))  # (P, Dh) Hugging Face's layout
        tsin = torch.from_numpy(np.concatenate([sin, sin], -1))  # (P, Dh)
        yield Case("rope (half)", f"{label} ({T}, {H}, {DH})", {
            "ours": lambda: cpu.rope(q, positions, cos, sin, "half"),  # in place: a rotation keeps values bounded
            "numpy": lambda: reference.rope(q, positions, cos, sin, "half"),
            "torch": lambda: tq * tcos[tpos][:, None] + rotate_half(tq) * tsin[tpos][:, None],
        }, 2 * T * H * DH * 4, 6 * T * H * DH)

        gate, up = rand(rng, T, FFN, scale=3.0), rand(rng, T, FFN)
        tg, tu = torch.from_numpy(gate), torch.from_numpy(up)
        yield Case("swiglu", f"{label} ({T}, {FFN})", {
            "ours": lambda: cpu.swiglu(gate, up),
            "numpy": lambda: reference.swiglu(gate, up),
            "torch": lambda: F.silu(tg) * tu,
        }, 3 * T * FFN * 4, 5 * T * FFN)

    for label, shape in (("logits", (1, VOCAB)), ("scores", (H * prefill_t, prefill_t))):
        s = rand(rng, *shape, scale=4.0)
        ts = torch.from_numpy(s)
        yield Case("softmax", f"{label} {shape}", {
            "ours": lambda: cpu.softmax(s),
            "numpy": lambda: reference.softmax(s),
            "torch": lambda: torch.softmax(ts, dim=-1),
        }, 2 * s.size * 4, 4 * s.size)


def attention_ops(rng, contexts: tuple[int, ...], prefill_contexts: tuple[int, ...]) -> Iterator[Case]:
    for S in contexts:
        q, k, v = rand(rng, H, DH), rand(rng, S, HKV, DH), rand(rng, S, HKV, DH)
        tq = torch.from_numpy(q)[None, :, None]                                   # (1, H, 1, Dh)
        tk, tv = (torch.from_numpy(a).transpose(0, 1)[None] for a in (k, v))      # (1, Hkv, S, Dh)
        yield Case("attention_decode", f"context {S}", {
            "ours": lambda: cpu.attention_decode(q, k, v, S),
            "numpy": lambda: reference.attention_decode(q, k, v, S),
            "torch": lambda: F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True),
        }, (2 * S * HKV * DH + 2 * H * DH) * 4, 4 * H * S * DH)
    for T in prefill_contexts:
        q, k, v = rand(rng, T, H, DH), rand(rng, T, HKV, DH), rand(rng, T, HKV, DH)
        tq = torch.from_numpy(q).transpose(0, 1)[None]                            # (1, H, T, Dh)
        tk, tv = (torch.from_numpy(a).transpose(0, 1)[None] for a in (k, v))      # (1, Hkv, T, Dh)
        impls = {
            "ours": lambda: cpu.attention(q, k, v, 0),
            "torch": lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True),
        }
        if T <= 1024:  # the spec materialises (H, T, T) scores: 600 MB at 4096
            impls["numpy"] = lambda: reference.attention(q, k, v, 0)
        yield Case("attention prefill", f"T {T}, causal", impls,
                           (2 * T * H * DH + 2 * T * HKV * DH) * 4, 4 * H * DH * T * (T + 1) / 2)


def linear_ops(rng, prefill_t: int) -> Iterator[Case]:
    for n_out, n_in in ((D, D), (HKV * DH, D), (FFN, D), (D, FFN)):
        copies = max(1, 2 * L3_BYTES // (n_out * n_in * 4))  # cycle through > 2x L3 of weights
        ws = [rand(rng, n_out, n_in) for _ in range(copies)]
        tws = [torch.from_numpy(w) for w in ws]
        x = rand(rng, 1, n_in)
        tx = torch.from_numpy(x)
        turn = {"ours": 0, "numpy": 0, "torch": 0}

        def cycling(name, fn):
            def call():
                turn[name] = (turn[name] + 1) % copies
                return fn(turn[name])
            return call

        yield Case("linear (matvec)", f"decode 1x{n_in} -> {n_out}", {
            "ours": cycling("ours", lambda i: cpu.linear(x, ws[i])),
            "numpy": cycling("numpy", lambda i: x @ ws[i].T),
            "torch": cycling("torch", lambda i: F.linear(tx, tws[i])),
        }, n_out * n_in * 4, 2 * n_out * n_in)
    for T in (16, prefill_t):
        w, x = rand(rng, FFN, D), rand(rng, T, D)
        tw, tx = torch.from_numpy(w), torch.from_numpy(x)
        yield Case("linear", f"{T}x{D} -> {FFN}", {
            "ours": lambda: cpu.linear(x, w),
            "numpy": lambda: x @ w.T,
            "torch": lambda: F.linear(tx, tw),
        }, (FFN * D + T * D + T * FFN) * 4, 2 * T * D * FFN)


def matmul_ladder(rng, m: int) -> Iterator[Case]:
    """Each rung against BLAS at m x 576 x 1536 (v1 on fewer rows: it is ~100x slower)."""
    b = rand(rng, D, FFN)
    tb = torch.from_numpy(b)
    for rung in (cpu.matmul_v1_naive, cpu.matmul_v2_streaming, cpu.matmul_v3_blocked, cpu.matmul_v4_parallel):
        rows_a = m // 16 if rung is cpu.matmul_v1_naive else m
        a = rand(rng, rows_a, D)
        ta = torch.from_numpy(a)
        yield Case(rung.__name__, f"{rows_a}x{D} @ {D}x{FFN}", {
            "ours": lambda: rung(a, b),
            "numpy": lambda: a @ b,
            "torch": lambda: ta @ tb,
        }, (rows_a * D + D * FFN + rows_a * FFN) * 4, 2 * rows_a * D * FFN,
            samples_scale=1 / 3 if rung is cpu.matmul_v1_naive else 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer samples, smaller shapes")
    add_isa_and_out(parser, "kernels_cpu")
    args = parser.parse_args()
    samples = 5 if args.quick else 9
    threads = default_threads()
    contenders = [Contender(side, "Kernels", {"side": side, "samples": samples, "quick": args.quick},
                            source=Path(__file__)) for side in SIDES]
    workers = start_all(contenders, args.isa, threads)
    print(f"{threads} threads each, {args.isa} code; per case {TURNS} turns per process, the median of {samples} "
          f"samples each, median of the turns")
    rows = []
    for index, case in enumerate(cases(args.quick)):  # the parent's copy: names and sizes only, in step
        turns = take_turns(workers, TURNS, "measure", index=index)
        rows.append(row(case, {side: statistics.median(s) for side, s in turns.items()}))
    stamps = {name: w.stamp for name, w in workers.items()}
    for worker in workers.values():
        worker.close()
    save_result("kernels_cpu_quick" if args.quick else "kernels_cpu", {
        "quick": args.quick, "isa": args.isa, "turns": TURNS, "samples_per_turn": samples, "threads": threads,
        "stamps": stamps,
        "model_shapes": {"hidden": D, "ffn": FFN, "heads": H, "kv_heads": HKV, "head_dim": DH, "vocab": VOCAB},
        "cases": rows,
    }, args.out)


if __name__ == "__main__":
    main()
