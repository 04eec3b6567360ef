"""Matrix multiplication on the GPU, as a ladder: naive -> shared-memory tiles -> register tiles.

Each rung keeps the arithmetic (2*M*N*K FLOPs) and cuts the memory traffic per FLOP:

- v1 `matmul_naive`: one thread per output, reading a row of A and a column of B from global memory
  (DRAM, ~3-5 TB/s on a data-centre GPU): 2 loads per multiply-add. Memory-bound far below peak.
- v2 `matmul_tiled`: a block stages a TILE x TILE tile of A and of B in shared memory (on-chip,
  ~20x DRAM's bandwidth) and every element is reused TILE times from there: global loads / TILE.
- v3 `matmul_register_tiled`: each thread computes a THREAD_TILE x THREAD_TILE patch of outputs,
  keeping them in registers (the fastest memory there is); each value read from shared memory feeds
  THREAD_TILE multiply-adds, so shared-memory traffic falls by THREAD_TILE too.

The model's `linear(x, w)` (w stored (out, in), as in every checkpoint) uses a transposing tiled
kernel for prefill and a warp-per-row kernel for decode, where x is one row and every weight is
used once: a memory-bound matrix-vector product whose only goal is to stream w at full bandwidth.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from minillm.kernels.cuda.basics import warp_sum
from minillm.kernels.cuda.setup import WARP, blocks_for, empty_gpu, launch, to_gpu, to_host
from minillm.kernels.shapes import check_linear, check_matmul

# -----------------------------------------------------------------------------------------------
# v1: one thread per output


NAIVE_BLOCK = 16  # 16 x 16 = 256 threads per block


@cuda.jit
def matmul_naive_kernel(a, b, c):
    # x is the fastest-varying thread index, so a warp is 32 neighbouring *columns*: its loads of
    # b[k, col] and stores of c[row, col] are coalesced, and a[row, k] is one address (a broadcast).
    col, row = cuda.grid(2)
    if row < c.shape[0] and col < c.shape[1]:
        acc = float32(0.0)
        for k in range(a.shape[1]):
            acc += a[row, k] * b[k, col]
        c[row, col] = acc


def matmul_naive_gpu(a, b):
    """a (M, K), b (K, N) device arrays -> (M, N) device array."""
    c = empty_gpu((a.shape[0], b.shape[1]))  # (M, N)
    grid = (blocks_for(b.shape[1], NAIVE_BLOCK), blocks_for(a.shape[0], NAIVE_BLOCK))
    launch(matmul_naive_kernel[grid, (NAIVE_BLOCK, NAIVE_BLOCK)], a, b, c)
    return c


def matmul_naive(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a (M, K) @ b (K, N) -> (M, N), one GPU thread per output (rung 1 of the ladder)."""
    check_matmul(a, b)
    return to_host(matmul_naive_gpu(to_gpu(a), to_gpu(b)))


# -----------------------------------------------------------------------------------------------
# v2: shared-memory tiles

TILE = 16  # a block of TILE x TILE threads computes a TILE x TILE tile of C
PADDED_TILE = TILE + 1  # shared-array shapes must be compile-time constants: no arithmetic inline


@cuda.jit
def matmul_tiled_kernel(a, b, c):
    a_tile = cuda.shared.array((TILE, TILE), float32)
    b_tile = cuda.shared.array((TILE, TILE), float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    row = cuda.blockIdx.y * TILE + ty
    col = cuda.blockIdx.x * TILE + tx
    M, K = a.shape
    N = b.shape[1]
    acc = float32(0.0)
    for k0 in range(0, K, TILE):
        # Each thread stages one element of each tile (coalesced along x); zeros pad the edges so
        # the inner loop needs no bounds checks. Threads outside C still load and still reach the
        # barriers: a thread that returned early would leave the others waiting forever.
        a_tile[ty, tx] = a[row, k0 + tx] if row < M and k0 + tx < K else float32(0.0)
        b_tile[ty, tx] = b[k0 + ty, col] if k0 + ty < K and col < N else float32(0.0)
        cuda.syncthreads()  # the tiles are complete
        for k in range(TILE):
            acc += a_tile[ty, k] * b_tile[k, tx]
        cuda.syncthreads()  # everyone is done with the tiles before they are overwritten
    if row < M and col < N:
        c[row, col] = acc


def matmul_tiled_gpu(a, b):
    """a (M, K), b (K, N) device arrays -> (M, N) device array."""
    c = empty_gpu((a.shape[0], b.shape[1]))  # (M, N)
    grid = (blocks_for(b.shape[1], TILE), blocks_for(a.shape[0], TILE))
    launch(matmul_tiled_kernel[grid, (TILE, TILE)], a, b, c)
    return c


def matmul_tiled(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a (M, K) @ b (K, N) -> (M, N), tiles staged in shared memory (rung 2 of the ladder)."""
    check_matmul(a, b)
    return to_host(matmul_tiled_gpu(to_gpu(a), to_gpu(b)))


# -----------------------------------------------------------------------------------------------
# v3: register tiles - several outputs per thread

BLOCK_TILE = 32  # a block computes a BLOCK_TILE x BLOCK_TILE tile of C ...
K_TILE = 16  # ... stepping through K this many columns at a time
THREAD_TILE = 4  # each thread owns THREAD_TILE x THREAD_TILE outputs
THREADS_SIDE = BLOCK_TILE // THREAD_TILE  # 8 x 8 = 64 threads per block
A_LOADS = BLOCK_TILE * K_TILE // (THREADS_SIDE * THREADS_SIDE)  # elements each thread stages
B_LOADS = K_TILE * BLOCK_TILE // (THREADS_SIDE * THREADS_SIDE)


@cuda.jit
def matmul_register_tiled_kernel(a, b, c):
    a_tile = cuda.shared.array((BLOCK_TILE, K_TILE), float32)
    b_tile = cuda.shared.array((K_TILE, BLOCK_TILE), float32)
    acc = cuda.local.array((THREAD_TILE, THREAD_TILE), float32)  # registers, if fully unrolled
    a_frag = cuda.local.array(THREAD_TILE, float32)
    b_frag = cuda.local.array(THREAD_TILE, float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    tid = ty * THREADS_SIDE + tx
    row0 = cuda.blockIdx.y * BLOCK_TILE
    col0 = cuda.blockIdx.x * BLOCK_TILE
    M, K = a.shape
    N = b.shape[1]
    for i in range(THREAD_TILE):
        for j in range(THREAD_TILE):
            acc[i, j] = float32(0.0)
    for k0 in range(0, K, K_TILE):
        for n in range(A_LOADS):  # consecutive threads take consecutive k: coalesced rows of A
            e = n * THREADS_SIDE * THREADS_SIDE + tid
            r, k = e // K_TILE, e % K_TILE
            inside = row0 + r < M and k0 + k < K
            a_tile[r, k] = a[row0 + r, k0 + k] if inside else float32(0.0)
        for n in range(B_LOADS):  # consecutive threads take consecutive columns of B
            e = n * THREADS_SIDE * THREADS_SIDE + tid
            k, col = e // BLOCK_TILE, e % BLOCK_TILE
            inside = k0 + k < K and col0 + col < N
            b_tile[k, col] = b[k0 + k, col0 + col] if inside else float32(0.0)
        cuda.syncthreads()
        for k in range(K_TILE):
            # Thread (tx, ty) owns rows ty + THREADS_SIDE*i and columns tx + THREADS_SIDE*j: strided,
            # so the lanes of a warp read neighbouring columns of b_tile (no bank conflicts) and
            # store neighbouring columns of C (coalesced).
            for i in range(THREAD_TILE):
                a_frag[i] = a_tile[ty + THREADS_SIDE * i, k]
            for j in range(THREAD_TILE):
                b_frag[j] = b_tile[k, tx + THREADS_SIDE * j]
            for i in range(THREAD_TILE):  # THREAD_TILE^2 multiply-adds from 2*THREAD_TILE loads
                for j in range(THREAD_TILE):
                    acc[i, j] += a_frag[i] * b_frag[j]
        cuda.syncthreads()
    for i in range(THREAD_TILE):
        for j in range(THREAD_TILE):
            row = row0 + ty + THREADS_SIDE * i
            col = col0 + tx + THREADS_SIDE * j
            if row < M and col < N:
                c[row, col] = acc[i, j]


def matmul_register_tiled_gpu(a, b):
    """a (M, K), b (K, N) device arrays -> (M, N) device array."""
    c = empty_gpu((a.shape[0], b.shape[1]))  # (M, N)
    grid = (blocks_for(b.shape[1], BLOCK_TILE), blocks_for(a.shape[0], BLOCK_TILE))
    launch(matmul_register_tiled_kernel[grid, (THREADS_SIDE, THREADS_SIDE)], a, b, c)
    return c


def matmul_register_tiled(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a (M, K) @ b (K, N) -> (M, N), several outputs per thread in registers (rung 3)."""
    check_matmul(a, b)
    return to_host(matmul_register_tiled_gpu(to_gpu(a), to_gpu(b)))


def matmul_gpu(a, b):
    """The top of the ladder, for device arrays."""
    return matmul_register_tiled_gpu(a, b)


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a (M, K) @ b (K, N) -> (M, N) float32: the top rung of the ladder."""
    check_matmul(a, b)
    return to_host(matmul_gpu(to_gpu(a), to_gpu(b)))


# -----------------------------------------------------------------------------------------------
# linear: x @ w.T with w stored (out, in)
#
# Decode (a few rows of x): one warp per output. The warp's lanes walk along w's row together,
# 32 consecutive floats per step - each step one 128-byte line, the ideal access - and meet in a
# shuffle reduction at the end. Every weight is read once per token: the kernel is a memory copy
# with some arithmetic attached, and its speed is the GPU's memory bandwidth.

MATVEC_MAX_T = 8  # up to this many rows of x: warp-per-output; beyond, the tiled kernel
MATVEC_WARPS = 4  # warps (outputs) per block


@cuda.jit
def linear_matvec_kernel(x, w, out):
    """x (T, in), w (out, in) -> out (T, out); block (i, t) computes MATVEC_WARPS outputs of row t."""
    t = cuda.blockIdx.y
    o = cuda.blockIdx.x * MATVEC_WARPS + cuda.threadIdx.x // WARP  # this warp's output
    lane = cuda.threadIdx.x % WARP
    if o >= w.shape[0]:
        return  # the whole warp leaves together: no lane is missing from the shuffles below
    acc = float32(0.0)
    for k in range(lane, w.shape[1], WARP):
        acc += w[o, k] * x[t, k]
    acc = warp_sum(acc)
    if lane == 0:
        out[t, o] = acc


# Prefill: the v2 tiles, with w's tile read along its rows (coalesced) and stored transposed in
# shared memory. The +1 column of padding moves each row of the tile to a different bank: without
# it, reading a column of a 16-wide float32 tile would hit the same banks and serialise.


@cuda.jit
def linear_tiled_kernel(x, w, out):
    x_tile = cuda.shared.array((TILE, TILE), float32)
    w_tile = cuda.shared.array((TILE, PADDED_TILE), float32)  # w_tile[k, o], padded
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    row = cuda.blockIdx.y * TILE + ty  # row of x / out
    col = cuda.blockIdx.x * TILE + tx  # output feature
    T, K = x.shape
    N = w.shape[0]
    w_row = cuda.blockIdx.x * TILE + ty  # the row of w this thread stages
    acc = float32(0.0)
    for k0 in range(0, K, TILE):
        x_tile[ty, tx] = x[row, k0 + tx] if row < T and k0 + tx < K else float32(0.0)
        w_tile[tx, ty] = w[w_row, k0 + tx] if w_row < N and k0 + tx < K else float32(0.0)
        cuda.syncthreads()
        for k in range(TILE):
            acc += x_tile[ty, k] * w_tile[k, tx]
        cuda.syncthreads()
    if row < T and col < N:
        out[row, col] = acc


def linear_gpu(x, w):
    """x (T, in), w (out, in) device arrays -> (T, out) device array."""
    T, N = x.shape[0], w.shape[0]
    out = empty_gpu((T, N))  # (T, out)
    if T <= MATVEC_MAX_T:
        launch(linear_matvec_kernel[(blocks_for(N, MATVEC_WARPS), T), MATVEC_WARPS * WARP], x, w, out)
    else:
        launch(linear_tiled_kernel[(blocks_for(N, TILE), blocks_for(T, TILE)), (TILE, TILE)], x, w, out)
    return out


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (T, in), w (out, in) -> (T, out) = x @ w.T."""
    check_linear(x, w)
    return to_host(linear_gpu(to_gpu(x), to_gpu(w)))
