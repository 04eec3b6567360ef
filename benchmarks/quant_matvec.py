"""The quantized matvec (decode's kernel) and batched matmul side by side with fp32 BLAS, at SmolLM2-135M's shapes.

    .venv/bin/python benchmarks/quant_matvec.py            # the full run (about a minute)
    .venv/bin/python benchmarks/quant_matvec.py --quick    # a smoke run (fewer repetitions, fewer copies)

Contenders, one process, one after the other:
- qmatvec: minillm.kernels.quant.qmatvec on the packed blocks (Q4_1 layers, the Q8_0 LM head);
- numba fp32: minillm.kernels.cpu.linear at T == 1 (our fp32 matvec) on the dequantized weights;
- BLAS gemv: NumPy's w @ x on the same fp32 weights.

Two regimes. "streamed": each contender cycles through enough copies of its weights to overflow
the L3 cache, as decode does - SmolLM2's 30 layers are 66 MB packed and 540 MB in fp32, so every
token reads its weights from DRAM. "cached": one matrix, called again and again, stays in L2/L3;
there fp32 BLAS has no memory wall to hide behind. The LM head is too big for any cache: streamed
only. Reported: microseconds per call (best sample), GB/s of the bytes each contender must read (packed
bytes for qmatvec, 4 bytes per weight for fp32), and speedups (> 1: qmatvec is faster).

Then the batch: T rows at once (T decode streams, or a prefill), one matrix (cached), for the two
paths `quant.qlinear` chooses between - qmatvec once per row, and qmatmul (each weight decoded once
into a tile, multiplied by all T rows) - and BLAS's fp32 x @ W.T. Reported: microseconds, GFLOP/s
(2 T rows cols flops), and qmatmul's speedup over both. The crossover sets quant.MATVEC_ROWS_MAX_T.
Results: benchmarks/results/quant_matvec.json.

Threads: Numba's and OpenBLAS's defaults (all cores). On a busy machine - or a VM where waking a
sleeping helper thread costs milliseconds - compare one core each, where no helper thread can
stall a call:

    OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1 .venv/bin/python benchmarks/quant_matvec.py --quick
"""
from __future__ import annotations

import argparse
import os
import time

import numba
import numpy as np
from common import save_result

from minillm.kernels import cpu, quant

L3_BYTES = 32 << 20
SAMPLE_SECONDS = 1e-3
SETTLE_SECONDS = 0.3  # for the other contender's threads to stop spinning
WARMUP_SECONDS = 0.05
CASES = [  # name, rows (out), cols (in), format
    ("ffn_gate/up", 1536, 576, "Q4_1"),
    ("ffn_down", 576, 1536, "Q4_1"),
    ("attn_q/o", 576, 576, "Q4_1"),
    ("attn_k/v", 192, 576, "Q4_1"),
    ("lm_head", 49152, 576, "Q8_0"),
]

def copies_to_overflow_l3(nbytes: int, factor: float) -> int:
    return max(1, int(np.ceil(factor * L3_BYTES / nbytes)))


def cycling(fn, operands: list):
    """A callable that, called once, calls fn on every operand in turn (one pass over the copies)."""
    def one_pass():
        for operand in operands:
            fn(operand)
    return one_pass


def best_seconds_per_call(contenders: dict, calls_per_pass: dict, reps: int) -> dict[str, float]:
    """Seconds per call of each contender in its best sample. The best, not the median: noise only
    ever makes a sample slower. Contenders run one after the other, not interleaved, each after a
    pause and a warm-up: OpenBLAS's threads spin for a while after a call and steal the cores from
    Numba's, and a thread pool that has gone to sleep takes milliseconds to wake on a VM."""
    best = {}
    for name, run in contenders.items():
        time.sleep(SETTLE_SECONDS)
        warm_until, durations = time.perf_counter() + WARMUP_SECONDS, []
        while time.perf_counter() < warm_until or len(durations) < 3:  # compile, fault in, wake threads
            start = time.perf_counter()
            run()
            durations.append(time.perf_counter() - start)
        passes = max(1, int(SAMPLE_SECONDS / min(durations)))
        samples = []
        for _ in range(reps):
            start = time.perf_counter()
            for _ in range(passes):
                run()
            samples.append((time.perf_counter() - start) / passes / calls_per_pass[name])
        best[name] = min(samples)
    return best


def bench_case(rows: int, cols: int, qtype: str, regime: str, reps: int, overflow: float) -> dict:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)  # (rows, cols)
    qm = quant.quantize(w, qtype)
    w32 = qm.dequantize()  # (rows, cols) the same weights in fp32
    x = rng.standard_normal(cols).astype(np.float32)  # (cols,)
    x2 = x[None, :]  # (1, cols)

    n_q = copies_to_overflow_l3(qm.nbytes, overflow) if regime == "streamed" else 1
    n_f = copies_to_overflow_l3(w32.nbytes, overflow) if regime == "streamed" else 1
    packed = [quant.QMatrix(qtype, qm.shape, qm.data.copy()) for _ in range(n_q)]
    fp32 = [w32.copy() for _ in range(n_f)]

    contenders = {"qmatvec": cycling(lambda m: quant.qmatvec(x, m), packed),
                  "numba_fp32": cycling(lambda m: cpu.linear(x2, m), fp32),
                  "blas_gemv": cycling(lambda m: m @ x, fp32)}
    calls = {"qmatvec": n_q, "blas_gemv": n_f, "numba_fp32": n_f}
    seconds = best_seconds_per_call(contenders, calls, reps)

    bytes_read = {"qmatvec": qm.nbytes, "blas_gemv": w32.nbytes, "numba_fp32": w32.nbytes}
    result = {"shape": [rows, cols], "format": qtype, "regime": regime,
              "copies": {"packed": n_q, "fp32": n_f}, "packed_bytes": qm.nbytes, "fp32_bytes": w32.nbytes}
    for contender, s in seconds.items():
        result[contender] = {"us": s * 1e6, "gb_per_s": bytes_read[contender] / s / 1e9}
    result["speedup_vs_blas_gemv"] = seconds["blas_gemv"] / seconds["qmatvec"]
    result["speedup_vs_numba_fp32"] = seconds["numba_fp32"] / seconds["qmatvec"]
    return result


BATCH_CASES = [CASES[0], CASES[1]]  # the FFN shapes, where most of a forward's flops go
BATCH_SIZES = (1, 2, 3, 4, 8, 16, 64)


def bench_batched(rows: int, cols: int, qtype: str, T: int, reps: int) -> dict:
    rng = np.random.default_rng(T)
    qm = quant.quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), qtype)
    w32 = qm.dequantize()  # (rows, cols)
    x = rng.standard_normal((T, cols)).astype(np.float32)  # (T, cols)
    contenders = {"qmatvec_per_row": lambda: [quant.qmatvec(row, qm) for row in x],
                  "qmatmul": lambda: quant.qmatmul(x, qm),
                  "blas_matmul": lambda: x @ w32.T}
    seconds = best_seconds_per_call(contenders, dict.fromkeys(contenders, 1), reps)
    flops = 2 * T * rows * cols
    result = {"shape": [rows, cols], "format": qtype, "T": T}
    for contender, sec in seconds.items():
        result[contender] = {"us": sec * 1e6, "gflops": flops / sec / 1e9}
    result["qmatmul_speedup_vs_qmatvec_per_row"] = seconds["qmatvec_per_row"] / seconds["qmatmul"]
    result["qmatmul_speedup_vs_blas_matmul"] = seconds["blas_matmul"] / seconds["qmatmul"]
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer repetitions and copies")
    args = parser.parse_args()
    reps, overflow = (5, 1.25) if args.quick else (25, 2.0)

    threads = {"numba": numba.get_num_threads(), "openblas_env": os.environ.get("OPENBLAS_NUM_THREADS", "default")}
    print(f"threads: numba {threads['numba']}, OpenBLAS {threads['openblas_env']}; best of {reps} samples")
    results = []
    print(f"{'case':<12} {'format':<5} {'regime':<9} {'qmatvec us (GB/s)':>18} {'numba fp32 us':>14} "
          f"{'BLAS gemv us':>13} {'vs BLAS':>8} {'vs numba':>9}")
    for name, rows, cols, qtype in CASES:
        for regime in ("streamed", "cached") if name != "lm_head" else ("streamed",):
            r = bench_case(rows, cols, qtype, regime, reps, overflow)
            results.append({"case": name, **r})
            print(f"{name:<12} {qtype:<5} {regime:<9} {r['qmatvec']['us']:9.1f} ({r['qmatvec']['gb_per_s']:5.1f}) "
                  f"{r['numba_fp32']['us']:14.1f} {r['blas_gemv']['us']:13.1f} {r['speedup_vs_blas_gemv']:7.2f}x "
                  f"{r['speedup_vs_numba_fp32']:8.2f}x")
    batched = []
    print(f"\n{'case':<12} {'T':>3} {'qmatvec per row us':>19} {'qmatmul us (GFLOP/s)':>21} {'BLAS matmul us':>15} "
          f"{'vs per row':>11} {'vs BLAS':>8}")
    for name, rows, cols, qtype in BATCH_CASES:
        for T in BATCH_SIZES:
            r = bench_batched(rows, cols, qtype, T, reps)
            batched.append({"case": name, **r})
            print(f"{name:<12} {T:>3} {r['qmatvec_per_row']['us']:19.1f} {r['qmatmul']['us']:12.1f} "
                  f"({r['qmatmul']['gflops']:5.1f}) {r['blas_matmul']['us']:15.1f} "
                  f"{r['qmatmul_speedup_vs_qmatvec_per_row']:10.2f}x {r['qmatmul_speedup_vs_blas_matmul']:7.2f}x")
    save_result("quant_matvec", {"quick": args.quick, "threads": threads, "cases": results, "batched": batched})


if __name__ == "__main__":
    main()
