"""Chapter 02's kernels side by side with NumPy and PyTorch, at SmolLM2-135M shapes.

    .venv/bin/python benchmarks/kernels_cpu.py            # the full run (a few minutes)
    .venv/bin/python benchmarks/kernels_cpu.py --quick    # a smoke run (fewer repetitions, smaller shapes)

For every case the three implementations run in one process, their repetitions interleaved
(ours, numpy, torch, ours, ...) so that a noisy neighbour hurts all of them alike; each sample
repeats a call until it lasts ~1 ms, and the median sample is reported with the bandwidth and
FLOP/s it achieves and the speed ratios (> 1: ours is faster). "numpy" is the NumPy
specification (minillm.kernels.reference) or plain NumPy/BLAS; "torch" is PyTorch eager on all
cores. Decode-shaped linear layers cycle through enough weight copies to overflow the L3
cache, as a real model's 30 layers do. Results: benchmarks/results/kernels_cpu.json.

Threads: all three use Numba's thread count (all cores unless NUMBA_NUM_THREADS says otherwise).
On a busy machine compare one core each, where a descheduled helper thread cannot stall a call:

    OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1 .venv/bin/python benchmarks/kernels_cpu.py --quick
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numba
import numpy as np
import torch
import torch.nn.functional as F
from common import save_result
from transformers.models.llama.modeling_llama import rotate_half

from minillm.kernels import cpu, reference

# SmolLM2-135M
D, FFN, H, HKV, DH, VOCAB, EPS, THETA = 576, 1536, 9, 3, 64, 49152, 1e-5, 100000.0
L3_BYTES = 32 << 20
SAMPLE_SECONDS = 1e-3


# -----------------------------------------------------------------------------
# timing


def calls_per_sample(fn) -> int:
    """How many back-to-back calls make one sample of about SAMPLE_SECONDS."""
    fn()  # warm up: compile, fault in memory
    start = time.perf_counter()
    fn()
    once = time.perf_counter() - start
    return max(1, int(SAMPLE_SECONDS / max(once, 1e-7)))


def measure(impls: dict, reps: int) -> dict[str, float]:
    """Median seconds per call of each implementation, repetitions interleaved."""
    counts = {name: calls_per_sample(fn) for name, fn in impls.items()}
    samples = {name: [] for name in impls}
    for _ in range(reps):
        for name, fn in impls.items():
            fn()  # untimed: wakes this implementation's thread pool after the others ran
            start = time.perf_counter()
            for _ in range(counts[name]):
                fn()
            samples[name].append((time.perf_counter() - start) / counts[name])
    return {name: statistics.median(s) for name, s in samples.items()}


def report(op: str, shape: str, impls: dict, reps: int, nbytes: float, flops: float) -> dict:
    seconds = measure(impls, reps)
    row = {"op": op, "shape": shape, "bytes": nbytes, "flops": flops, "impls": {}}
    for name, s in seconds.items():
        row["impls"][name] = {"median_s": s, "GB_s": nbytes / s / 1e9, "GFLOP_s": flops / s / 1e9}
    ours = seconds["ours"]
    row["speedup"] = {f"vs_{name}": s / ours for name, s in seconds.items() if name != "ours"}
    rates = "  ".join(f"{n} {v['median_s'] * 1e6:9.1f} us" for n, v in row["impls"].items())
    ratios = "  ".join(f"{k} {v:5.2f}x" for k, v in row["speedup"].items())
    main = f"{flops / ours / 1e9:7.1f} GFLOP/s" if flops > 2 * nbytes else f"{nbytes / ours / 1e9:7.1f} GB/s"
    print(f"{op:18s} {shape:28s} {rates}  | ours {main} | {ratios}")
    return row


def rand(rng, *shape, scale=1.0) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)


# -----------------------------------------------------------------------------
# the cases


def fused_ops(rng, reps: int, prefill_t: int) -> list[dict]:
    rows = []
    w_norm = rand(rng, D)
    tw = torch.from_numpy(w_norm)
    cos, sin = reference.rope_table(DH, 8192, THETA)
    for label, T in (("decode", 1), ("prefill", prefill_t)):
        x = rand(rng, T, D)
        tx = torch.from_numpy(x)
        rows.append(report("rms_norm", f"{label} ({T}, {D})", {
            "ours": lambda: cpu.rms_norm(x, w_norm, EPS),
            "numpy": lambda: reference.rms_norm(x, w_norm, EPS),
            "torch": lambda: F.rms_norm(tx, (D,), tw, EPS),
        }, reps, (2 * T * D + D) * 4, 4 * T * D))

        q = rand(rng, T, H, DH)
        positions = np.arange(100, 100 + T)
        tq, tpos = torch.from_numpy(q.copy()), torch.from_numpy(positions)          # (T, H, Dh), (T,)
        tcos = torch.from_numpy(np.concatenate([cos, cos], -1))  # (P, Dh) Hugging Face's layout
        tsin = torch.from_numpy(np.concatenate([sin, sin], -1))  # (P, Dh)
        rows.append(report("rope (half)", f"{label} ({T}, {H}, {DH})", {
            "ours": lambda: cpu.rope(q, positions, cos, sin, "half"),  # in place: a rotation keeps values bounded
            "numpy": lambda: reference.rope(q, positions, cos, sin, "half"),
            "torch": lambda: tq * tcos[tpos][:, None] + rotate_half(tq) * tsin[tpos][:, None],
        }, reps, 2 * T * H * DH * 4, 6 * T * H * DH))

        gate, up = rand(rng, T, FFN, scale=3.0), rand(rng, T, FFN)
        tg, tu = torch.from_numpy(gate), torch.from_numpy(up)
        rows.append(report("swiglu", f"{label} ({T}, {FFN})", {
            "ours": lambda: cpu.swiglu(gate, up),
            "numpy": lambda: reference.swiglu(gate, up),
            "torch": lambda: F.silu(tg) * tu,
        }, reps, 3 * T * FFN * 4, 5 * T * FFN))

    for label, shape in (("logits", (1, VOCAB)), ("scores", (H * prefill_t, prefill_t))):
        s = rand(rng, *shape, scale=4.0)
        ts = torch.from_numpy(s)
        rows.append(report("softmax", f"{label} {shape}", {
            "ours": lambda: cpu.softmax(s),
            "numpy": lambda: reference.softmax(s),
            "torch": lambda: torch.softmax(ts, dim=-1),
        }, reps, 2 * s.size * 4, 4 * s.size))
    return rows


def attention_ops(rng, reps: int, contexts: tuple[int, ...], prefill_contexts: tuple[int, ...]) -> list[dict]:
    rows = []
    for S in contexts:
        q, k, v = rand(rng, H, DH), rand(rng, S, HKV, DH), rand(rng, S, HKV, DH)
        tq = torch.from_numpy(q)[None, :, None]                                   # (1, H, 1, Dh)
        tk, tv = (torch.from_numpy(a).transpose(0, 1)[None] for a in (k, v))      # (1, Hkv, S, Dh)
        rows.append(report("attention_decode", f"context {S}", {
            "ours": lambda: cpu.attention_decode(q, k, v, S),
            "numpy": lambda: reference.attention_decode(q, k, v, S),
            "torch": lambda: F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True),
        }, reps, (2 * S * HKV * DH + 2 * H * DH) * 4, 4 * H * S * DH))
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
        rows.append(report("attention prefill", f"T {T}, causal", impls, reps,
                           (2 * T * H * DH + 2 * T * HKV * DH) * 4, 4 * H * DH * T * (T + 1) / 2))
    return rows


def linear_ops(rng, reps: int, prefill_t: int) -> list[dict]:
    rows = []
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

        rows.append(report("linear (matvec)", f"decode 1x{n_in} -> {n_out}", {
            "ours": cycling("ours", lambda i: cpu.linear(x, ws[i])),
            "numpy": cycling("numpy", lambda i: x @ ws[i].T),
            "torch": cycling("torch", lambda i: F.linear(tx, tws[i])),
        }, reps, n_out * n_in * 4, 2 * n_out * n_in))
    for T in (16, prefill_t):
        w, x = rand(rng, FFN, D), rand(rng, T, D)
        tw, tx = torch.from_numpy(w), torch.from_numpy(x)
        rows.append(report("linear", f"{T}x{D} -> {FFN}", {
            "ours": lambda: cpu.linear(x, w),
            "numpy": lambda: x @ w.T,
            "torch": lambda: F.linear(tx, tw),
        }, reps, (FFN * D + T * D + T * FFN) * 4, 2 * T * D * FFN))
    return rows


def matmul_ladder(rng, reps: int, m: int) -> list[dict]:
    """Each rung against BLAS at m x 576 x 1536 (v1 on fewer rows: it is ~100x slower)."""
    rows = []
    b = rand(rng, D, FFN)
    tb = torch.from_numpy(b)
    for rung in (cpu.matmul_v1_naive, cpu.matmul_v2_streaming, cpu.matmul_v3_blocked, cpu.matmul_v4_parallel):
        rows_a = m // 16 if rung is cpu.matmul_v1_naive else m
        a = rand(rng, rows_a, D)
        ta = torch.from_numpy(a)
        rows.append(report(rung.__name__, f"{rows_a}x{D} @ {D}x{FFN}", {
            "ours": lambda: rung(a, b),
            "numpy": lambda: a @ b,
            "torch": lambda: ta @ tb,
        }, reps if rung is not cpu.matmul_v1_naive else max(3, reps // 3),
            (rows_a * D + D * FFN + rows_a * FFN) * 4, 2 * rows_a * D * FFN))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer repetitions, smaller shapes")
    args = parser.parse_args()
    threads = numba.get_num_threads()
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    if args.quick:
        reps, prefill_t, contexts, prefill_contexts, ladder_m = 5, 128, (128, 1024), (128,), 128
    else:
        reps, prefill_t, contexts, prefill_contexts, ladder_m = 21, 512, (128, 1024, 4096), (128, 1024, 4096), 512
    print(f"{os.cpu_count()} cores; threads: numba {threads}, torch {torch.get_num_threads()}; "
          f"{reps} interleaved repetitions, medians")
    cases = (fused_ops(rng, reps, prefill_t) + attention_ops(rng, reps, contexts, prefill_contexts)
             + linear_ops(rng, reps, prefill_t) + matmul_ladder(rng, reps, ladder_m))
    save_result("kernels_cpu_quick" if args.quick else "kernels_cpu", {
        "quick": args.quick, "repetitions": reps, "threads": threads,
        "model_shapes": {"hidden": D, "ffn": FFN, "heads": H, "kv_heads": HKV, "head_dim": DH, "vocab": VOCAB},
        "cases": cases,
    })


if __name__ == "__main__":
    main()
