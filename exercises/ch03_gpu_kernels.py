"""Chapter 03 exercises: your first CUDA kernels, in Numba.

Each task is a host function the tests call with NumPy arrays. Inside it you write a `@cuda.jit`
kernel (at module level, next to the function), copy the inputs to the GPU, launch the kernel on a
grid you choose, and copy the result back:

    @cuda.jit
    def my_kernel(a, out):
        i = cuda.grid(1)                  # this thread's global index
        if i < out.shape[0]:              # the last block overhangs the end
            out[i] = ...

    def my_op(a):
        d_a = to_gpu(a)                   # host -> device (float32, C-contiguous)
        d_out = empty_gpu(a.shape[0])     # device memory for the result
        my_kernel[blocks_for(a.shape[0], 256), 256](d_a, d_out)   # [blocks, threads per block]
        return d_out.copy_to_host()       # device -> host

No GPU? The tests run your kernels on Numba's CUDA simulator, one Python thread per GPU thread:

    NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest tests/cuda \
        -m "ch03_vector_add or ch03_block_reduce or ch03_tiled_matmul or ch03_rmsnorm" --impl=exercises

Keep block sizes a multiple of 32 (a warp). The simulator is slow: the tests use tiny shapes.
When you are done (or stuck), REFERENCE names the package's version of each function.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32  # noqa: F401  (your kernels need them)

from minillm.kernels.cuda.setup import FULL_MASK, WARP, blocks_for, empty_gpu, threads_for, to_gpu  # noqa: F401

REFERENCE = {
    "vector_add": "minillm.kernels.cuda.vector_add",
    "reduce_sum": "minillm.kernels.cuda.reduce_sum",
    "matmul_tiled": "minillm.kernels.cuda.matmul_tiled",
    "rms_norm": "minillm.kernels.cuda.rms_norm",
}

# The functions each task (pytest marker) grades: course.check(marker) runs its tests.
TASKS = {
    "ch03_vector_add": ["vector_add"],
    "ch03_block_reduce": ["reduce_sum"],
    "ch03_tiled_matmul": ["matmul_tiled"],
    "ch03_rmsnorm": ["rms_norm"],
}


def vector_add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Task 1 - the CUDA hello world: a, b (n,) float32 -> (n,) a + b, one thread per element.

    Write a kernel where thread i = cuda.grid(1) adds element i (and does nothing when i >= n),
    launch ceil(n / 256) blocks of 256 threads, and return the sum as a NumPy array.
    Why this access pattern is fast: the 32 lanes of a warp touch 32 neighbouring floats, which
    the memory system serves as one 128-byte transaction (coalescing).
    """
    raise NotImplementedError("chapter 3, task 1")


def reduce_sum(x: np.ndarray) -> float:
    """Task 2 - a block reduction: sum(x) of a float32 vector (n,) -> a Python float.

    1. Each thread accumulates a grid-stride share of x into a register
       (i = cuda.grid(1); while i < n: acc += x[i]; i += cuda.gridsize(1)).
    2. The block reduces the threads' values: store them in a cuda.shared.array, then halve the
       active threads round by round (thread t < stride adds slot t + stride), with
       cuda.syncthreads() after each round, until 32 values remain.
    3. The last 32 values: one warp reads them into registers and finishes with
       cuda.shfl_down_sync(FULL_MASK, value, offset) for offset = 16, 8, 4, 2, 1 (no barriers -
       the lanes of a warp run in lockstep). Every thread of the warp must take part.
    4. Thread 0 writes the block's sum to partial_sums[blockIdx.x]. Blocks cannot wait for each
       other, so launch the kernel a second time, one block over the partial sums.
    Use a power-of-two block size >= 32 (threads_for(n) gives one).
    """
    raise NotImplementedError("chapter 3, task 2")


def matmul_tiled(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Task 3 - shared-memory tiled matmul: a (M, K) @ b (K, N) -> (M, N) float32.

    Launch (ceil(N / TILE), ceil(M / TILE)) blocks of (TILE, TILE) threads, TILE = 16; thread
    (tx, ty) of block (bx, by) computes c[by*TILE + ty, bx*TILE + tx]. Step through K a tile at a
    time: each thread loads one element of the A tile and one of the B tile into
    cuda.shared.array((TILE, TILE), float32) (zero where the tile overhangs the matrix),
    cuda.syncthreads(), accumulates TILE products from shared memory, cuda.syncthreads() again
    before the next tiles overwrite these. Every element loaded from DRAM is reused TILE times.
    Careful: threads outside C must still load tiles and reach every barrier (no early return).
    Sizes need not be multiples of TILE.
    """
    raise NotImplementedError("chapter 3, task 3")


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Task 4 - RMSNorm with one block per row: x (T, D), weight (D,) -> (T, D) float32.

    out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight. Launch T blocks; the threads of block t
    stride along row t (i = threadIdx.x, i + blockDim.x, ...) summing squares, reduce those sums
    across the block (task 2's block reduction, so that every thread learns the total), then
    each thread writes its elements scaled by 1 / rms. Pass eps to the kernel as np.float32.
    """
    raise NotImplementedError("chapter 3, task 4")
