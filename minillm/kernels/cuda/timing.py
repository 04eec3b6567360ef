"""The CUDA kernels at a model's shapes, each with the work it does: what a GPU timing measures.

A kernel's place on the roofline needs two numbers besides its time: the FLOPs it performs and
the bytes it must move to and from device memory (each input read once, each output written once -
the minimum; caches can only help). `model_kernel_runs` builds device-resident inputs at the shapes
of a model config (a minillm.model.ModelConfig: hidden_size, intermediate_size, heads, head_dim,
vocab_size, rope_theta) and pairs every kernel launch with those two counts. Timing them is the
hardware layer's (`minillm.hardware.gpu.event_seconds`, CUDA events), as is the FP32 peak. Used by
chapter 03 (on a GPU) and benchmarks/kernels_cuda.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from minillm.kernels.cuda.contiguous_attention import attention_gpu
from minillm.kernels.cuda.basics import reduce_sum_gpu, vector_add_gpu
from minillm.kernels.cuda.matmul_ladder import linear_gpu, matmul_naive_gpu, matmul_register_tiled_gpu, matmul_tiled_gpu
from minillm.kernels.cuda.ops import embedding_gpu, rms_norm_gpu, rope_gpu, softmax_gpu, swiglu_gpu
from minillm.kernels.cuda.quant import GPUQMatrix, qlinear_gpu
from minillm.kernels.cuda.setup import to_gpu
from minillm.kernels.quant_formats import quantize
from minillm.kernels.reference import rope_table



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


def model_kernel_runs(config, tokens: int, context: int, seed: int = 0) -> list[KernelRun]:
    """Every kernel of one layer of ``config``'s model (and its LM head) for `tokens` new tokens at
    `context` keys. tokens = 1 is a decode step; tokens = context a prefill of the whole context.
    """
    D, F, V = config.hidden_size, config.intermediate_size, config.vocab_size
    H, Hkv, Dh = config.n_heads, config.n_kv_heads, config.head_dim
    rng = np.random.default_rng(seed)

    def device(*shape):
        return to_gpu(rng.standard_normal(shape).astype(np.float32))

    T, C = tokens, context
    x, norm_w = device(T, D), device(D)
    w_up = device(F, D)
    gate, up = device(T * F), device(T * F)
    q, k, v = device(T, H, Dh), device(C, Hkv, Dh), device(C, Hkv, Dh)
    cos, sin = (to_gpu(table) for table in rope_table(Dh, C, config.rope_theta))
    positions = to_gpu(np.arange(C - T, C), np.int64)
    q4_up = GPUQMatrix.upload(quantize(rng.standard_normal((F, D)).astype(np.float32), "Q4_1"))
    q8_head = GPUQMatrix.upload(quantize(rng.standard_normal((V, D)).astype(np.float32), "Q8_0"))
    table = device(V, D)
    ids = to_gpu(rng.integers(0, V, T), np.int64)
    x_last, logits = device(1, D), device(1, V)  # logits are needed for the last token only
    f = 4  # bytes per float32
    linear_flops = 2 * T * F * D
    activations = f * T * (D + F)  # x in, y out
    # causal: query t sees C - T + t + 1 keys; QK^T and PV are 2 FLOPs per (key, dim) each
    keys_seen = T * (C - T) + T * (T + 1) / 2
    return [
        KernelRun("rms_norm", rms_norm_gpu, (x, norm_w, 1e-5), 4 * T * D, f * (2 * T * D + D)),
        KernelRun(f"linear fp32 {D}->{F}", linear_gpu, (x, w_up), linear_flops, f * F * D + activations),
        KernelRun(f"qlinear Q4_1 {D}->{F}", qlinear_gpu, (x, q4_up), linear_flops, q4_up.data.nbytes + activations),
        KernelRun("rope q", rope_gpu, (q, positions, cos, sin, "pairs"), 6 * T * H * Dh // 2,
                  f * (2 * T * H * Dh + T * Dh)),
        KernelRun("attention", attention_gpu, (q, k, v, C - T, 1 / math.sqrt(Dh)),
                  4 * H * Dh * keys_seen, f * (2 * T * H * Dh + 2 * C * Hkv * Dh)),
        KernelRun("swiglu", swiglu_gpu, (gate, up), 5 * T * F, f * 3 * T * F),
        KernelRun("embedding", embedding_gpu, (ids, table), 0, f * 2 * T * D),
        KernelRun(f"lm head qlinear Q8_0 {D}->{V}", qlinear_gpu, (x_last, q8_head), 2 * V * D,
                  q8_head.data.nbytes + f * (D + V)),
        KernelRun("softmax over the vocabulary", softmax_gpu, (logits,), 4 * V, f * 2 * V),
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
