"""Timing the CUDA kernels on a real GPU, and the work each does at the default model's shapes.

A kernel's place on the roofline needs two numbers besides its time: the FLOPs it performs and
the bytes it must move to and from device memory (each input read once, each output written once -
the minimum; caches can only help). `smollm2_kernel_runs` builds device-resident inputs at
SmolLM2-135M's shapes and pairs every kernel launch with those two counts; `time_gpu` times a
launch with CUDA events. Used by chapter 03 (on a GPU) and benchmarks/kernels_cuda.py.

Under the simulator none of this measures anything (events record no time): it needs a GPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
from numba import cuda

from minillm.kernels.cuda_attention import attention_gpu
from minillm.kernels.cuda_basics import reduce_sum_gpu, vector_add_gpu
from minillm.kernels.cuda_matmul import linear_gpu, matmul_naive_gpu, matmul_register_tiled_gpu, matmul_tiled_gpu
from minillm.kernels.cuda_ops import embedding_gpu, rms_norm_gpu, rope_gpu, softmax_gpu, swiglu_gpu
from minillm.kernels.cuda_quant import GPUQMatrix, qlinear_gpu
from minillm.kernels.cuda_setup import to_gpu
from minillm.kernels.quant import quantize
from minillm.kernels.reference import rope_table

# SmolLM2-135M (REFERENCE.md): the shapes every decode step runs 30 times
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 576, 1536, 9, 3, 64, 49152
ROPE_THETA = 100000.0

# FP32 lanes (CUDA cores) per SM by compute capability, from NVIDIA's CUDA C++ Programming Guide
FP32_LANES_PER_SM = {(7, 0): 64, (7, 5): 64, (8, 0): 64, (8, 6): 128, (8, 7): 128, (8, 9): 128,
                     (9, 0): 128, (10, 0): 128, (12, 0): 128}


@dataclass(frozen=True)
class KernelRun:
    name: str
    op: Callable  # a *_gpu function of the cuda_*.py files ...
    args: tuple  # ... and its inputs, already on the GPU
    flops: float
    bytes: float  # the minimum traffic: inputs read once, outputs written once

    def run(self):
        return self.op(*self.args)

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


def time_gpu(run: Callable[[], object], repeats: int = 20) -> float:
    """Median seconds per call, each timed with CUDA events, after one warm-up call (it compiles).

    One call at a time, as decode issues them: the time includes the launch latency.
    """
    run()
    cuda.synchronize()
    start, end = cuda.event(), cuda.event()
    times = []
    for _ in range(repeats):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return float(np.median(times))


def fp32_peak_flops() -> float | None:
    """SMs x FP32 lanes per SM x 2 (a fused multiply-add) x clock; None for an unknown architecture."""
    device = cuda.get_current_device()
    lanes = FP32_LANES_PER_SM.get(tuple(device.compute_capability))
    if lanes is None:
        return None
    return device.MULTIPROCESSOR_COUNT * lanes * 2 * device.CLOCK_RATE * 1e3


def smollm2_kernel_runs(tokens: int, context: int, seed: int = 0) -> list[KernelRun]:
    """Every kernel of a SmolLM2 layer (and the LM head) for `tokens` new tokens at `context` keys.

    tokens = 1 is a decode step; tokens = context a prefill of the whole context.
    """
    rng = np.random.default_rng(seed)

    def device(*shape):
        return to_gpu(rng.standard_normal(shape).astype(np.float32))

    T, C = tokens, context
    x, norm_w = device(T, HIDDEN), device(HIDDEN)
    w_up = device(FFN, HIDDEN)
    gate, up = device(T * FFN), device(T * FFN)
    q, k, v = device(T, HEADS, HEAD_DIM), device(C, KV_HEADS, HEAD_DIM), device(C, KV_HEADS, HEAD_DIM)
    cos, sin = (to_gpu(table) for table in rope_table(HEAD_DIM, C, ROPE_THETA))
    positions = to_gpu(np.arange(C - T, C), np.int64)
    q4_up = GPUQMatrix(quantize(rng.standard_normal((FFN, HIDDEN)).astype(np.float32), "Q4_1"))
    q8_head = GPUQMatrix(quantize(rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32), "Q8_0"))
    table = device(VOCAB, HIDDEN)
    ids = to_gpu(rng.integers(0, VOCAB, T), np.int64)
    x_last, logits = device(1, HIDDEN), device(1, VOCAB)  # logits are needed for the last token only
    f = 4  # bytes per float32
    linear_flops = 2 * T * FFN * HIDDEN
    activations = f * T * (HIDDEN + FFN)  # x in, y out
    # causal: query t sees C - T + t + 1 keys; QK^T and PV are 2 FLOPs per (key, dim) each
    keys_seen = T * (C - T) + T * (T + 1) / 2
    return [
        KernelRun("rms_norm", rms_norm_gpu, (x, norm_w, 1e-5), 4 * T * HIDDEN, f * (2 * T * HIDDEN + HIDDEN)),
        KernelRun(f"linear fp32 {HIDDEN}->{FFN}", linear_gpu, (x, w_up), linear_flops, f * FFN * HIDDEN + activations),
        KernelRun(f"qlinear Q4_1 {HIDDEN}->{FFN}", qlinear_gpu, (x, q4_up), linear_flops, q4_up.data.nbytes + activations),
        KernelRun("rope q", rope_gpu, (q, positions, cos, sin, "pairs"), 6 * T * HEADS * HEAD_DIM // 2,
                  f * (2 * T * HEADS * HEAD_DIM + T * HEAD_DIM)),
        KernelRun("attention", attention_gpu, (q, k, v, C - T, 1 / math.sqrt(HEAD_DIM)),
                  4 * HEADS * HEAD_DIM * keys_seen, f * (2 * T * HEADS * HEAD_DIM + 2 * C * KV_HEADS * HEAD_DIM)),
        KernelRun("swiglu", swiglu_gpu, (gate, up), 5 * T * FFN, f * 3 * T * FFN),
        KernelRun("embedding", embedding_gpu, (ids, table), 0, f * 2 * T * HIDDEN),
        KernelRun(f"lm head qlinear Q8_0 {HIDDEN}->{VOCAB}", qlinear_gpu, (x_last, q8_head), 2 * VOCAB * HIDDEN,
                  q8_head.data.nbytes + f * (HIDDEN + VOCAB)),
        KernelRun("softmax over the vocabulary", softmax_gpu, (logits,), 4 * VOCAB, f * 2 * VOCAB),
    ]


def ladder_runs(n: int, seed: int = 0) -> list[KernelRun]:
    """The chapter's teaching kernels at size n: vector add and reduction of n*n floats, n^3 matmuls."""
    rng = np.random.default_rng(seed)
    a = to_gpu(rng.standard_normal((n, n)).astype(np.float32))
    b = to_gpu(rng.standard_normal((n, n)).astype(np.float32))
    flat_a, flat_b = a.reshape(n * n), b.reshape(n * n)
    matmul_bytes = 4 * 3 * n * n
    return [
        KernelRun("vector_add", vector_add_gpu, (flat_a, flat_b), n * n, 4 * 3 * n * n),
        KernelRun("reduce_sum", reduce_sum_gpu, (flat_a,), n * n, 4 * n * n),
        KernelRun("matmul v1 naive", matmul_naive_gpu, (a, b), 2 * n**3, matmul_bytes),
        KernelRun("matmul v2 tiled", matmul_tiled_gpu, (a, b), 2 * n**3, matmul_bytes),
        KernelRun("matmul v3 register-tiled", matmul_register_tiled_gpu, (a, b), 2 * n**3, matmul_bytes),
    ]
