"""The CUDA basics: a vector add (the hello world) and reductions (shared memory, then warp shuffles).

The execution model, in the words the kernels below use:

- A kernel is one function run by many threads. `kernel[blocks, threads](args)` launches a *grid*
  of `blocks` thread *blocks* of `threads` threads each; each thread finds its work from
  `cuda.blockIdx`, `cuda.threadIdx` and `cuda.blockDim` (or `cuda.grid(1)`, which combines them).
- SIMT: the hardware runs threads in *warps* of 32 that execute one instruction together. If the
  lanes of a warp disagree at an `if`, the warp runs both sides one after the other, masking lanes
  off (divergence) - so branches should split along warp boundaries, or be short.
- A block runs on one streaming multiprocessor (SM) and shares its fast on-chip *shared memory*
  (~100-228 KB per SM) and `cuda.syncthreads()`, a barrier for the block's threads. Blocks cannot
  wait for each other: the only grid-wide barrier is the end of the kernel.
- Coalescing: when the 32 lanes of a warp load 32 consecutive float32s, the hardware fetches one
  128-byte line; scattered addresses cost one transaction each. Thread i touching element i is the
  pattern every kernel here follows.
- Occupancy: an SM holds a limited number of threads (2048 on recent GPUs), blocks, registers and
  shared memory; whichever a kernel's blocks exhaust first caps how many warps are resident. While
  some warps wait on memory the SM runs others, so more resident warps hide more latency - up to
  the point where spending registers on data reuse is worth more (the register-tiled matmul).
- A launch costs ~5-10 us of CPU and driver time before the GPU starts, whatever the work: tiny
  kernels are launch-bound, which is why decode (hundreds of small kernels per token) fuses ops.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from minillm.kernels.cuda.setup import FULL_MASK, MAX_THREADS, WARP, blocks_for, empty_gpu, launch, threads_for, to_gpu, to_host

# -----------------------------------------------------------------------------------------------
# Vector add: one thread per element

VECTOR_THREADS = 256  # 8 warps per block; the grid supplies as many blocks as the vector needs


@cuda.jit
def vector_add_kernel(a, b, out):
    i = cuda.grid(1)  # blockIdx.x * blockDim.x + threadIdx.x: this thread's element
    if i < out.shape[0]:  # the last block overhangs the end of the vector
        out[i] = a[i] + b[i]  # neighbouring lanes, neighbouring addresses: coalesced


def vector_add_gpu(a, b):
    """a, b (n,) device arrays -> (n,) device array a + b."""
    out = empty_gpu(a.shape[0])  # (n,)
    launch(vector_add_kernel[blocks_for(a.shape[0], VECTOR_THREADS), VECTOR_THREADS], a, b, out)
    return out


def vector_add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a, b (n,) float32 -> (n,) a + b, computed on the GPU (copy in, one launch, copy out)."""
    if a.ndim != 1 or a.shape != b.shape:
        raise ValueError(f"vector_add needs two vectors of one length, got shapes {a.shape} and {b.shape}")
    return to_host(vector_add_gpu(to_gpu(a), to_gpu(b)))


# -----------------------------------------------------------------------------------------------
# Reductions: a tree in shared memory down to one warp's worth, then shuffles in registers
#
# Summing n numbers in parallel takes log2(n) rounds of pairwise adds. Across the warps of a block
# the partial sums meet in shared memory, with a barrier per round. Inside a warp the 32 lanes run
# in lockstep and can read each other's registers directly with `cuda.shfl_down_sync`: no shared
# memory, no barrier - the last five rounds are nearly free.
# The same code serves sums and maxima (rms_norm needs a sum, softmax a max and a sum).


@cuda.jit(device=True)
def _add(a, b):
    return a + b


@cuda.jit(device=True)
def _max(a, b):
    return max(a, b)


def _make_reductions(combine):
    @cuda.jit(device=True)
    def warp_reduce(value):
        """Combine `value` over the 32 lanes; every lane gets the result.

        Round by round, lane i adds the value of lane i + 16, then i + 8, ... i + 1, so lane 0 ends
        with all 32 (the others hold partial results); shfl_sync then broadcasts lane 0's.
        """
        offset = WARP // 2
        while offset > 0:
            value = combine(value, cuda.shfl_down_sync(FULL_MASK, value, offset))
            offset //= 2
        return cuda.shfl_sync(FULL_MASK, value, 0)

    @cuda.jit(device=True)
    def block_reduce(value, scratch):
        """Combine `value` over the block's threads; every thread gets the result.

        blockDim.x must be a power of two >= 32, and scratch a shared float32 array of that many
        slots. Every thread of the block must call it (it contains barriers).
        """
        t = cuda.threadIdx.x
        scratch[t] = value
        cuda.syncthreads()
        stride = cuda.blockDim.x // 2
        while stride >= WARP:  # tree: the lower half adds in the upper half, until 32 remain
            if t < stride:
                scratch[t] = combine(scratch[t], scratch[t + stride])
            cuda.syncthreads()  # the round is finished before anyone reads its results
            stride //= 2
        # Every warp reduces the same 32 partials: redundant work that costs less than a barrier
        # and a broadcast through shared memory, and leaves the result in every thread.
        result = warp_reduce(scratch[t % WARP])
        cuda.syncthreads()  # all have read scratch before the caller reuses it
        return result

    return warp_reduce, block_reduce


warp_sum, block_sum = _make_reductions(_add)
_, block_max = _make_reductions(_max)


@cuda.jit
def sum_kernel(x, partial_sums):
    """Each block sums a grid-strided share of x into partial_sums[blockIdx.x]."""
    scratch = cuda.shared.array(MAX_THREADS, float32)  # on-chip, one per block
    acc = float32(0.0)
    i = cuda.grid(1)
    while i < x.shape[0]:  # grid-stride loop: a fixed grid covers any n, coalesced at every step
        acc += x[i]
        i += cuda.gridsize(1)
    total = block_sum(acc, scratch)
    if cuda.threadIdx.x == 0:
        partial_sums[cuda.blockIdx.x] = total


REDUCE_MAX_BLOCKS = MAX_THREADS  # so the second pass fits in one block


def reduce_sum_gpu(x):
    """x (n,) device array -> (1,) device array holding sum(x).

    Blocks cannot wait for one another inside a kernel, so the block sums meet in a second launch:
    the kernel boundary is the grid-wide barrier.
    """
    n = x.shape[0]
    threads = threads_for(n)
    blocks = min(blocks_for(n, threads), REDUCE_MAX_BLOCKS)
    partial_sums = empty_gpu(blocks)  # (blocks,)
    launch(sum_kernel[blocks, threads], x, partial_sums)
    if blocks == 1:
        return partial_sums
    total = empty_gpu(1)  # (1,)
    launch(sum_kernel[1, threads_for(blocks)], partial_sums, total)
    return total


def reduce_sum(x: np.ndarray) -> float:
    """sum(x) of a float32 vector, on the GPU: a block reduction, then one more for the block sums."""
    if x.ndim != 1 or x.shape[0] == 0:
        raise ValueError(f"reduce_sum needs a non-empty vector, got shape {x.shape}")
    return float(to_host(reduce_sum_gpu(to_gpu(x)))[0])
