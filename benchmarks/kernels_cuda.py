"""minillm's CUDA kernels against PyTorch's, at SmolLM2-135M's shapes, on one GPU.

    .venv/bin/python benchmarks/kernels_cuda.py [--contexts 128 1024 4096] [--repeats 20]

For each context length: a decode step (1 new token over `context` keys) and a prefill (`context`
tokens), every kernel of a layer plus the LM head. Each kernel runs on inputs already on the GPU
(no PCIe copies in the times); PyTorch's equivalent runs on the very same device memory (shared
through __cuda_array_interface__), and the two outputs are compared. Reported: median microseconds,
achieved GB/s and GFLOP/s (minimum traffic and FLOP counts from minillm.kernels.cuda.timing), and
torch_us / our_us (> 1: ours is faster). For the quantized linears PyTorch has no Q4_1/Q8_0 kernel:
it runs the fp32 linear on the dequantized weights, i.e. what you would do without a fused kernel.
Also the matmul ladder at 1024^3, the GPU's measured copy bandwidth and FP32 peak, and paged decode
attention (one launch, keys found through shuffled block tables) against the contiguous attention
kernel (one launch per sequence, keys in order) for 1 and 8 sequences of 1024 keys.

Needs a CUDA GPU. Without one (or under NUMBA_ENABLE_CUDASIM=1, whose timings mean nothing) it
prints why and exits with status 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from common import save_result
from minillm.hardware.gpu import describe_gpu, device_bandwidth, event_seconds, fp32_peak_flops
from minillm.kernels.cuda import contiguous_attention as cuda_attention
from minillm.kernels.cuda import basics as cuda_basics
from minillm.kernels.cuda import matmul_ladder as cuda_matmul
from minillm.kernels.cuda import ops as cuda_ops
from minillm.kernels.cuda import quant as cuda_quant
from minillm.kernels.cuda import timing as cuda_timing
from minillm.kernels.cuda.paged_attention import paged_attention_gpu
from minillm.kernels.cuda.setup import SIMULATOR, cuda_available, to_gpu
from minillm.model.config import ModelConfig
from minillm.model.fetch import cached_model_path, fetch

EXIT_NO_GPU = 2
LADDER_SIZE = 1024
PAGED_CONTEXT, PAGED_BATCHES, PAGED_BLOCK_SIZE = 1024, (1, 8), 16  # the engine's default block size


# -----------------------------------------------------------------------------------------------
# PyTorch's equivalent of each *_gpu op, on the same device memory


def torch_equivalents():
    import torch
    import torch.nn.functional as F

    def rope(x, positions, cos, sin, style):
        c, s = cos[positions][:, None, :], sin[positions][:, None, :]  # (T, 1, Dh/2)
        if style == "pairs":
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    def attention(q, k, v, start, scale):
        T, S = q.shape[0], start + q.shape[0]
        if T > 1 and start != 0:
            raise ValueError("the benchmark's torch attention covers decode (T = 1) and full prefill (start = 0)")
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k[:S].transpose(0, 1)[None], v[:S].transpose(0, 1)[None],
            is_causal=T > 1, scale=scale, enable_gqa=True)  # (1, H, T, Dh)
        return out[0].transpose(0, 1)  # (T, H, Dh)

    return {
        cuda_ops.rms_norm_gpu: lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps),
        cuda_matmul.linear_gpu: F.linear,
        cuda_quant.qlinear_gpu: F.linear,  # on the dequantized weights
        cuda_ops.rope_gpu: rope,
        cuda_attention.attention_gpu: attention,
        cuda_ops.swiglu_gpu: lambda gate, up: F.silu(gate) * up,
        cuda_ops.embedding_gpu: F.embedding,
        cuda_ops.softmax_gpu: lambda x: torch.softmax(x, dim=-1),
        cuda_basics.vector_add_gpu: torch.add,
        cuda_basics.reduce_sum_gpu: lambda x: x.sum(),
        cuda_matmul.matmul_naive_gpu: torch.matmul,
        cuda_matmul.matmul_tiled_gpu: torch.matmul,
        cuda_matmul.matmul_register_tiled_gpu: torch.matmul,
    }


def as_torch(arg):
    """Device arrays -> torch tensors on the same memory; a quantized matrix -> its fp32 weights."""
    import torch

    if isinstance(arg, cuda_quant.GPUQMatrix):
        arg = cuda_quant.dequantize_gpu(arg)
    if hasattr(arg, "__cuda_array_interface__"):
        return torch.as_tensor(arg, device="cuda")
    return arg


# -----------------------------------------------------------------------------------------------


def measure(runs, equivalents, repeats: int) -> list[dict]:
    rows = []
    for run in runs:
        ours_s = float(np.median(event_seconds(run.run, repeats)))
        row = {"kernel": run.name, "our_us": ours_s * 1e6, "GB_per_s": run.bytes / ours_s / 1e9,
               "GFLOP_per_s": run.flops / ours_s / 1e9, "intensity_flop_per_byte": run.intensity,
               "torch_us": None, "torch_over_ours": None, "max_abs_diff": None}
        if equivalents is not None:
            fn, args = equivalents[run.op], tuple(as_torch(a) for a in run.args)
            theirs = fn(*args)
            ours = np.asarray(run.run().copy_to_host()).reshape(-1)[: theirs.numel()]  # reduce_sum: (1,)
            row["max_abs_diff"] = float(np.max(np.abs(ours - theirs.detach().cpu().numpy().reshape(-1))))
            torch_s = float(np.median(event_seconds(lambda: fn(*args), repeats)))  # both on the default stream
            row.update(torch_us=torch_s * 1e6, torch_over_ours=torch_s / ours_s)
        print(f"  {row['kernel']:42s} {row['our_us']:10.1f} us {row['GB_per_s']:8.1f} GB/s "
              f"{row['GFLOP_per_s']:9.1f} GFLOP/s"
              + (f"   torch {row['torch_us']:10.1f} us  ratio {row['torch_over_ours']:5.2f}"
                 f"  |diff| {row['max_abs_diff']:.1e}" if row["torch_us"] is not None else ""))
        rows.append(row)
    return rows


# -----------------------------------------------------------------------------------------------
# Paged against contiguous decode attention: what does the block-table lookup cost?


def paged_decode_runs(config: ModelConfig, batch: int, context: int, seed: int = 0) -> tuple[list[cuda_timing.KernelRun], float]:
    """Decode attention of `batch` sequences of `context` keys each, at the model's heads, two ways.

    The same keys in a contiguous cache per sequence and in shuffled blocks of one paged cache.
    -> the two runs, and the largest difference between their outputs.
    """
    rng = np.random.default_rng(seed)
    H, Hkv, Dh = config.n_heads, config.n_kv_heads, config.head_dim
    scale = 1 / np.sqrt(Dh)
    blocks_each = context // PAGED_BLOCK_SIZE
    q = rng.standard_normal((batch, H, Dh)).astype(np.float32)  # (B, H, Dh)
    k = rng.standard_normal((batch, context, Hkv, Dh)).astype(np.float32)  # (B, C, Hkv, Dh) in token order
    v = rng.standard_normal((batch, context, Hkv, Dh)).astype(np.float32)  # (B, C, Hkv, Dh)
    tables = rng.permutation(batch * blocks_each).reshape(batch, blocks_each).astype(np.int32)  # (B, C / bs)
    block_shape = (batch, blocks_each, PAGED_BLOCK_SIZE, Hkv, Dh)
    k_cache = np.empty((batch * blocks_each, PAGED_BLOCK_SIZE, Hkv, Dh), np.float32)  # (num_blocks, bs, Hkv, Dh)
    v_cache = np.empty_like(k_cache)  # (num_blocks, bs, Hkv, Dh)
    k_cache[tables], v_cache[tables] = k.reshape(block_shape), v.reshape(block_shape)  # token t -> its block

    paged_args = (to_gpu(q), to_gpu(k_cache), to_gpu(v_cache), to_gpu(tables, np.int32),
                  to_gpu(np.arange(batch), np.int64), to_gpu(np.full(batch, context), np.int64), context, scale)
    sequences = [(to_gpu(q[b:b + 1]), to_gpu(k[b]), to_gpu(v[b])) for b in range(batch)]  # (1, H, Dh), (C, Hkv, Dh) x 2

    def contiguous():
        return [cuda_attention.attention_gpu(q_b, k_b, v_b, context - 1, scale) for q_b, k_b, v_b in sequences]

    f = 4  # bytes per float32
    flops = 4 * batch * H * Dh * context  # QK^T and PV: 2 FLOPs per (key, dim) each
    traffic = f * batch * (2 * H * Dh + 2 * context * Hkv * Dh)  # q in, out, K and V read once
    runs = [cuda_timing.KernelRun(f"paged decode, batch {batch}, 1 launch", paged_attention_gpu, paged_args,
                                  flops, traffic + tables.nbytes),
            cuda_timing.KernelRun(f"contiguous decode, batch {batch}, {batch} launch(es)", contiguous, (),
                                  flops, traffic)]
    paged_out = runs[0].run().copy_to_host()  # (B, H, Dh)
    contiguous_out = np.concatenate([out.copy_to_host() for out in runs[1].run()])  # (B, H, Dh)
    return runs, float(np.max(np.abs(paged_out - contiguous_out)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--model", type=Path, default=None, help="GGUF file for the shapes (default: SmolLM2-135M)")
    args = parser.parse_args()

    available, reason = cuda_available()
    if SIMULATOR or not available:
        print(f"benchmarks/kernels_cuda.py needs a CUDA GPU: {reason}", file=sys.stderr)
        return EXIT_NO_GPU
    try:
        import torch

        equivalents = torch_equivalents() if torch.cuda.is_available() else None
    except ImportError:
        equivalents = None
    if equivalents is None:
        print("PyTorch with CUDA is not installed: timing minillm's kernels alone", file=sys.stderr)

    gpu = describe_gpu()
    bandwidth = device_bandwidth()
    peak = fp32_peak_flops()
    config = ModelConfig.from_gguf(args.model or cached_model_path() or fetch())  # the model's shapes
    print(f"{gpu.name}: {gpu.sm_count} SMs, copy bandwidth {bandwidth.bandwidth_gbs:,.0f} GB/s, "
          f"FP32 peak {peak / 1e12 if peak else float('nan'):.1f} TFLOP/s")
    results = {"gpu": gpu.__dict__, "copy_bandwidth_gbs": bandwidth.bandwidth_gbs, "fp32_peak_flops": peak,
               "torch_compared": equivalents is not None, "decode": {}, "prefill": {}}
    for context in args.contexts:
        for phase, tokens in (("decode", 1), ("prefill", context)):
            print(f"{phase}: {tokens} token(s), context {context}")
            runs = cuda_timing.model_kernel_runs(config, tokens, context)
            results[phase][str(context)] = measure(runs, equivalents, args.repeats)
    print(f"matmul ladder at {LADDER_SIZE}^3")
    results["ladder"] = measure(cuda_timing.ladder_runs(LADDER_SIZE), equivalents, args.repeats)
    results["paged_decode"] = {}
    for batch in PAGED_BATCHES:
        runs, diff = paged_decode_runs(config, batch, PAGED_CONTEXT)
        print(f"paged vs contiguous decode attention: {batch} sequence(s) of {PAGED_CONTEXT} keys, "
              f"blocks of {PAGED_BLOCK_SIZE}, |diff| {diff:.1e}")
        results["paged_decode"][str(batch)] = {"max_abs_diff": diff, "runs": measure(runs, None, args.repeats)}
    save_result("kernels_cuda", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
