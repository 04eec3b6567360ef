"""The CUDA backend: every operator of reference.py as Numba CUDA kernels, same names and signatures.

Each operator here is a *host wrapper*: it takes NumPy arrays, copies them to the GPU, launches the
kernel(s) and copies the result back. That makes the backend a drop-in for the registry (and lets
the tests compare it with the reference), but it pays a PCIe round trip per call; the `*_gpu`
variants in the files below take and return device arrays. The resident backend (resident.py) is
built on them: the whole model on the GPU (`LLM(device="cuda")`, minillm/model/device.py).

The kernels, one idea per file:
    cuda/setup.py      GPU or simulator? host<->device copies and launches (counted), launch geometry
    cuda/basics.py     vector add; reductions: shared-memory tree, then warp shuffles
    cuda/matmul_ladder.py     matmul ladder (naive -> shared-memory tiles -> register tiles); linear
    cuda/ops.py        embedding, rms_norm, softmax, rope, silu, swiglu
    cuda/contiguous_attention.py  causal GQA attention with the online softmax, one block per (query, head)
    cuda/paged_attention.py  the same over a paged KV cache: keys found through the block table; write_kv
    cuda/quant.py      Q8_0 / Q4_0 / Q4_1: fused quantized matvec (1-8 rows), tiled prefill, dequantize, embedding
    cuda/timing.py     each kernel at a model config's shapes, with its FLOPs and minimum bytes
    cuda/tensor.py     DeviceTensor: the forward's own array operations (reshape, slices, +, ...) on the GPU
    cuda/resident.py   the resident backend: every op on device arrays, weights uploaded once

Importing this module needs neither a GPU nor the simulator; calling an operator without either
raises a RuntimeError saying so (see `cuda_available()`).
"""
from minillm.kernels.cuda.contiguous_attention import attention, attention_decode
from minillm.kernels.cuda.basics import reduce_sum, vector_add
from minillm.kernels.cuda.matmul_ladder import linear, matmul, matmul_naive, matmul_register_tiled, matmul_tiled
from minillm.kernels.cuda.ops import embedding, rms_norm, rope, silu, softmax, swiglu
from minillm.kernels.cuda.paged_attention import paged_attention_decode, paged_attention_prefill, write_kv
from minillm.kernels.cuda.quant import dequantize, qembedding, qlinear, qmatvec
from minillm.kernels.cuda.setup import SIMULATOR, cuda_available
from minillm.kernels.reference import rope_table  # computed once per model, on the host: not a kernel

__all__ = [
    # the operator contract, shared with reference.py and cpu/__init__.py
    "linear", "matmul", "embedding", "rms_norm", "rope_table", "rope", "silu", "swiglu", "softmax",
    "attention", "attention_decode", "qlinear", "qembedding",
    "paged_attention_decode", "paged_attention_prefill", "write_kv",
    # the quantized kernels and the teaching kernels of chapter 03
    "qmatvec", "dequantize", "vector_add", "reduce_sum", "matmul_naive", "matmul_tiled",
    "matmul_register_tiled",
    # where the kernels run
    "cuda_available", "SIMULATOR",
]
