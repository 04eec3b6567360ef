"""The quantized matvec (decode's kernel) and batched matmul side by side with fp32 BLAS, at SmolLM2-135M's shapes.

    .venv/bin/python benchmarks/quant_matvec.py            # the full run (about a minute)
    .venv/bin/python benchmarks/quant_matvec.py --quick    # a smoke run (fewer repetitions, fewer copies)

Contenders, in two worker processes (benchmarks/common.py) with the same threads, so that OpenBLAS's
spinning threads never share a process with Numba's; the two take turns case by case, three times
(A, B, A, B, A, B), and the median of the three is reported:
- minillm's process: qmatvec (minillm.kernels.cpu.quant.qmatvec on the packed blocks, Q4_1 layers, the
  Q8_0 LM head) and numba fp32 (minillm.kernels.cpu.linear at T == 1, our fp32 matvec, on the
  dequantized weights);
- the BLAS process: NumPy's w @ x on the same fp32 weights (built there from the same seed).

Two regimes. "streamed": each contender cycles through enough copies of its weights to overflow
the L3 cache, as decode does - SmolLM2's 30 layers are 66 MB packed and 540 MB in fp32, so every
token reads its weights from DRAM. "cached": one matrix, called again and again, stays in L2/L3;
there fp32 BLAS has no memory wall to hide behind. The LM head is too big for any cache: streamed
only. Reported: microseconds per call (best sample), GB/s of the bytes each contender must read (packed
bytes for qmatvec, 4 bytes per weight for fp32), and speedups (> 1: qmatvec is faster).

Then the batch: T rows at once (T decode streams, or a prefill), one matrix (cached), for the two
paths `quant.qlinear` chooses between - qmatvec once per row, and qmatmul (each weight decoded once
into a tile, multiplied by all T rows), on the GGUF blocks and on the repacked weights the engine
loads - and BLAS's fp32 x @ W.T; and int8 mode's integer kernel (`quant.qlinear` on weights
repacked for int8 activations: quant_int8.matvec_rows up to 8 rows, matmul_rows beyond). Reported:
microseconds, GFLOP/s (2 T rows cols operations, integer ones for int8), qmatmul's speedup over
both, the repacked qmatmul's share of the FMA peak that minillm's process measures
(minillm.hardware.microbench.fma_flops, the same threads), and the int8 kernel's share of the
peak of its byte multiply-add (microbench.int8_dot_ops: vpdpbusd or vpmaddubsw). The crossover
sets quant.MATVEC_ROWS_MAX_T.
Results: benchmarks/results/quant_matvec.json.

Each of the three turns reports its best sample, not its median: noise only ever makes a sample
slower. Threads: min(physical cores, NUMBA_NUM_THREADS) for both processes; on a busy machine - or a
VM where waking a sleeping helper thread costs milliseconds - compare one core each:

    NUMBA_NUM_THREADS=1 .venv/bin/python benchmarks/quant_matvec.py --quick

(fewer threads than physical cores write quant_matvec_<n>thread.json, beside the cores' run).

``--isa avx2`` runs both processes on the AVX2 code path (Numba for Haswell, OPENBLAS_CORETYPE=Haswell).
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np
from common import (Contender, add_isa_and_out, default_threads, save_result, seconds_per_call, start_all,
                    take_turns)

from minillm.hardware.machine import describe_machine
from minillm.kernels.quant_formats import BLOCK_BYTES, BLOCK_SIZE
from minillm.model.config import ModelConfig
from minillm.model.fetch import cached_model_path, fetch

L3_BYTES = 32 << 20
TURNS = 3  # per case: minillm's process, BLAS's, three times
_C = ModelConfig.from_gguf(cached_model_path() or fetch())  # the default model's shapes, from its file
CASES = [  # name, rows (out), cols (in), format (as SmolLM2-135M's Q4_1 file stores them)
    ("ffn_gate/up", _C.intermediate_size, _C.hidden_size, "Q4_1"),
    ("ffn_down", _C.hidden_size, _C.intermediate_size, "Q4_1"),
    ("attn_q/o", _C.n_heads * _C.head_dim, _C.hidden_size, "Q4_1"),
    ("attn_k/v", _C.n_kv_heads * _C.head_dim, _C.hidden_size, "Q4_1"),
    ("lm_head", _C.vocab_size, _C.hidden_size, "Q8_0"),
]
BATCH_CASES = [CASES[0], CASES[1]]  # the FFN shapes, where most of a forward's flops go
BATCH_SIZES = (1, 2, 3, 4, 8, 16, 64, 256)
SIDES = ("minillm", "blas")


def copies_to_overflow_l3(nbytes: int, factor: float) -> int:
    return max(1, int(np.ceil(factor * L3_BYTES / nbytes)))


def cycling(fn, operands: list):
    """A callable that, called once, calls fn on every operand in turn (one pass over the copies)."""
    def one_pass():
        for operand in operands:
            fn(operand)
    return one_pass


def best_seconds(fn, calls_per_pass: int, samples: int) -> float:
    """Seconds per call in the best sample (noise only ever makes a sample slower)."""
    return min(seconds_per_call(fn, samples)) / calls_per_pass


class Kernels:
    """One side of the comparison, in a process of its own: minillm's Numba kernels, or NumPy's BLAS.

    Both sides build the same matrices from the same seeds; each method returns seconds per call of
    this side's contenders.
    """

    def __init__(self, threads: int, side: str):
        import numba

        numba.set_num_threads(threads)  # OpenBLAS takes OPENBLAS_NUM_THREADS from the worker's environment
        self.side = side

    def stamp(self) -> dict:
        import os

        import numba
        from common import numba_target

        if self.side == "minillm":
            return {"isa": numba_target()["isa"], "numba_threads": numba.get_num_threads()}
        # OpenBLAS does not say which kernels it picked; recorded is what it was told (DYNAMIC_ARCH build)
        coretype = os.environ.get("OPENBLAS_CORETYPE")
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return {"isa": "avx2" if coretype == "Haswell" else numba_target()["isa"], "openblas_coretype": coretype,
                "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS"), "blas": blas["name"] + " " + blas["version"]}

    def matvec(self, rows: int, cols: int, qtype: str, regime: str, samples: int, overflow: float) -> dict:
        from minillm.kernels import cpu
        from minillm.kernels.cpu import quant

        rng = np.random.default_rng(0)
        w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)  # (rows, cols)
        qm = quant.quantize(w, qtype)
        w32 = qm.dequantize()  # (rows, cols) the same weights in fp32
        x = rng.standard_normal(cols).astype(np.float32)  # (cols,)
        n_q = copies_to_overflow_l3(qm.nbytes, overflow) if regime == "streamed" else 1
        n_f = copies_to_overflow_l3(w32.nbytes, overflow) if regime == "streamed" else 1
        fp32 = [w32.copy() for _ in range(n_f)]
        if self.side == "blas":
            return {"blas_gemv": best_seconds(cycling(lambda m: m @ x, fp32), n_f, samples)}
        packed = [quant.QMatrix(qtype, qm.shape, qm.data.copy()) for _ in range(n_q)]
        return {"qmatvec": best_seconds(cycling(lambda m: quant.qmatvec(x, m), packed), n_q, samples),
                "numba_fp32": best_seconds(cycling(lambda m: cpu.linear(x[None, :], m), fp32), n_f, samples)}

    def fma_peak_gflops(self) -> float:
        import numba

        from minillm.hardware.microbench import fma_flops

        return fma_flops(threads=numba.get_num_threads()).gflops

    def int8_peak(self) -> dict:
        import numba

        from minillm.hardware.microbench import int8_dot_ops

        peak = int8_dot_ops(threads=numba.get_num_threads())
        return {"instruction": peak.instruction, "gops": peak.gops}

    def batched(self, rows: int, cols: int, qtype: str, T: int, samples: int) -> dict:
        from minillm.kernels.cpu import quant
        from minillm.kernels.cpu.quant_repack import repack

        rng = np.random.default_rng(T)
        qm = quant.quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), qtype)
        w32 = qm.dequantize()  # (rows, cols)
        x = rng.standard_normal((T, cols)).astype(np.float32)  # (T, cols)
        if self.side == "blas":
            return {"blas_matmul": best_seconds(lambda: x @ w32.T, 1, samples)}
        repacked, int8 = repack(qm), repack(qm, "int8")
        return {"qmatvec_per_row": best_seconds(lambda: [quant.qmatvec(row, qm) for row in x], 1, samples),
                "qmatmul": best_seconds(lambda: quant.qmatmul(x, qm), 1, samples),
                "qmatmul_repacked": best_seconds(lambda: quant.qmatmul(x, repacked), 1, samples),
                "int8_rows": best_seconds(lambda: quant.qlinear(x, int8), 1, samples)}


def side_by_side(workers: dict, method: str, **kwargs) -> dict[str, float]:
    """Seconds per call of every contender: the two processes take turns, the median of the turns."""
    return {contender: statistics.median(s) for contender, s in take_turns(workers, TURNS, method, **kwargs).items()}


def matvec_row(workers, name, rows, cols, qtype, regime, samples, overflow) -> dict:
    seconds = side_by_side(workers, "matvec", rows=rows, cols=cols, qtype=qtype, regime=regime, samples=samples,
                           overflow=overflow)
    packed_bytes = rows * cols // BLOCK_SIZE * BLOCK_BYTES[qtype]
    bytes_read = {"qmatvec": packed_bytes, "blas_gemv": rows * cols * 4, "numba_fp32": rows * cols * 4}
    result = {"case": name, "shape": [rows, cols], "format": qtype, "regime": regime, "packed_bytes": packed_bytes,
              "fp32_bytes": rows * cols * 4}
    for contender, s in seconds.items():
        result[contender] = {"us": s * 1e6, "gb_per_s": bytes_read[contender] / s / 1e9}
    result["speedup_vs_blas_gemv"] = seconds["blas_gemv"] / seconds["qmatvec"]
    result["speedup_vs_numba_fp32"] = seconds["numba_fp32"] / seconds["qmatvec"]
    return result


def batched_row(workers, name, rows, cols, qtype, T, samples, fma_peak: float, int8_peak: float) -> dict:
    seconds = side_by_side(workers, "batched", rows=rows, cols=cols, qtype=qtype, T=T, samples=samples)
    flops = 2 * T * rows * cols
    result = {"case": name, "shape": [rows, cols], "format": qtype, "T": T}
    for contender, s in seconds.items():
        result[contender] = {"us": s * 1e6, "gops" if contender == "int8_rows" else "gflops": flops / s / 1e9}
    result["qmatmul_speedup_vs_qmatvec_per_row"] = seconds["qmatvec_per_row"] / seconds["qmatmul"]
    result["qmatmul_speedup_vs_blas_matmul"] = seconds["blas_matmul"] / seconds["qmatmul"]
    result["qmatmul_repacked_share_of_fma_peak"] = result["qmatmul_repacked"]["gflops"] / fma_peak
    result["int8_rows_share_of_int8_peak"] = result["int8_rows"]["gops"] / int8_peak
    result["int8_rows_speedup_vs_qmatmul_repacked"] = seconds["qmatmul_repacked"] / seconds["int8_rows"]
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer samples and copies")
    add_isa_and_out(parser, "quant_matvec")
    args = parser.parse_args()
    samples, overflow = (5, 1.25) if args.quick else (15, 2.0)
    threads = default_threads()
    contenders = [Contender(side, "Kernels", {"side": side}, source=Path(__file__)) for side in SIDES]
    workers = start_all(contenders, args.isa, threads)
    print(f"{threads} threads each, {args.isa} code; per case {TURNS} turns per process, the best of {samples} "
          f"samples each, median of the turns")
    results = []
    print(f"{'case':<12} {'format':<5} {'regime':<9} {'qmatvec us (GB/s)':>18} {'numba fp32 us':>14} "
          f"{'BLAS gemv us':>13} {'vs BLAS':>8} {'vs numba':>9}")
    for name, rows, cols, qtype in CASES:
        for regime in ("streamed", "cached") if name != "lm_head" else ("streamed",):
            r = matvec_row(workers, name, rows, cols, qtype, regime, samples, overflow)
            results.append(r)
            print(f"{name:<12} {qtype:<5} {regime:<9} {r['qmatvec']['us']:9.1f} ({r['qmatvec']['gb_per_s']:5.1f}) "
                  f"{r['numba_fp32']['us']:14.1f} {r['blas_gemv']['us']:13.1f} {r['speedup_vs_blas_gemv']:7.2f}x "
                  f"{r['speedup_vs_numba_fp32']:8.2f}x")
    batched = []
    fma_peak = statistics.median(workers["minillm"].call("fma_peak_gflops")[0] for _ in range(TURNS))
    int8_peaks = [workers["minillm"].call("int8_peak")[0] for _ in range(TURNS)]
    int8_peak, int8_instruction = statistics.median(p["gops"] for p in int8_peaks), int8_peaks[0]["instruction"]
    print(f"\nFMA peak of minillm's process: {fma_peak:.0f} GFLOP/s; {int8_instruction} peak: {int8_peak:.0f} GOP/s")
    print(f"{'case':<12} {'T':>3} {'qmatvec per row us':>19} {'qmatmul us (GFLOP/s)':>21} {'repacked us (GFLOP/s, peak)':>28} "
          f"{'BLAS matmul us':>15} {'vs per row':>11} {'vs BLAS':>8} {'int8 us (GOP/s, peak)':>22}")
    for name, rows, cols, qtype in BATCH_CASES:
        for T in BATCH_SIZES:
            r = batched_row(workers, name, rows, cols, qtype, T, samples, fma_peak, int8_peak)
            batched.append(r)
            rq, r8 = r["qmatmul_repacked"], r["int8_rows"]
            print(f"{name:<12} {T:>3} {r['qmatvec_per_row']['us']:19.1f} {r['qmatmul']['us']:12.1f} "
                  f"({r['qmatmul']['gflops']:5.1f}) {rq['us']:12.1f} ({rq['gflops']:5.1f}, "
                  f"{r['qmatmul_repacked_share_of_fma_peak']:4.0%}) {r['blas_matmul']['us']:15.1f} "
                  f"{r['qmatmul_speedup_vs_qmatvec_per_row']:10.2f}x {r['qmatmul_speedup_vs_blas_matmul']:7.2f}x "
                  f"{r8['us']:9.1f} ({r8['gops']:5.1f}, {r['int8_rows_share_of_int8_peak']:4.0%})")
    stamps = {name: w.stamp for name, w in workers.items()}
    for worker in workers.values():
        worker.close()
    name = "quant_matvec" if threads == describe_machine().cores else f"quant_matvec_{threads}thread"
    save_result(name, {"quick": args.quick, "isa": args.isa, "threads": threads, "turns": TURNS,
                       "samples_per_turn": samples, "stamps": stamps, "cases": results,
                       "fma_peak_gflops": fma_peak, "int8_peak_gops": int8_peak,
                       "int8_peak_instruction": int8_instruction, "batched": batched}, args.out)


if __name__ == "__main__":
    main()
