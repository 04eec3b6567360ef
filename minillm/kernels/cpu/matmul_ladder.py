"""Matrix multiplication on the CPU, as a ladder of Numba kernels, plus the decode matvec.

Each rung keeps the arithmetic (2*M*N*K flops) and changes only how data moves:

  v1 naive      c[i, j] = dot(row i of a, column j of b); the column walk strides through
                memory, every b element comes from far away, nothing vectorises.
  v2 streaming  loop order i-k-j: c[i, :] += a[i, k] * b[k, :]. Rows are contiguous, so the
                inner loop is a vector FMA, but all of b streams through the cache for every i.
  v3 blocked    b is packed transposed (bt, N x K: "weights as stored"), then tiles are sized to
                caches: a block of NB bt rows stays in L2 while every 4-row strip of a (in L1)
                passes over it, and a 4 x 4 tile of c (2 x 4 on AVX2: see TILE_ROWS) lives in
                registers for the whole K loop: each loaded value feeds 4 FMAs instead of one.
  v4 parallel   v3 with the column blocks spread over the cores (prange): each core owns
                different bt rows, so nothing is shared or written twice.

``matvec`` is the decode shape (one activation row): a 1 x 8 register tile over the rows of w,
parallel over row blocks. It reads every weight exactly once, so it runs at memory bandwidth.
"""
import numpy as np
from numba import njit, prange

from minillm.hardware.machine import compile_target

# The register tile: TILE_ROWS x 4 outputs, each a vector of partial sums along K, plus one loaded
# vector per row of a and of bt. It must fit the register file: 4 x 4 = 16 accumulators + 8 loads
# fit AVX-512's 32 registers (and NEON's 32), but spill on AVX2's 16 - there 2 x 4 (8 + 6) fits.
# Measured, m=128 x 576 @ 576 x 64, one thread (2-core Zen 4; AVX2 code from NUMBA_CPU_NAME=haswell
# NUMBA_CPU_FEATURES=""): AVX2 4x4 59.5 GFLOP/s (72 spill/reload instructions), 2x4 88.1 (20);
# AVX-512 4x4 98.0, 2x4 88.9.
TILE_ROWS = 2 if compile_target().vector_bits == 256 else 4
TILE = 4  # columns of the tile (rows of bt), whatever the ISA
COLUMN_BLOCK = 64  # bt rows per cache block: 64 x K floats (147 KB at K=576) stay in L2


# -----------------------------------------------------------------------------
# v1 and v2: the loop order


@njit(cache=True)
def matmul_v1_naive(a, b):
    """(M, K) @ (K, N): one dot product per output, walking down columns of b."""
    M, K = a.shape
    if b.shape[0] != K:
        raise ValueError("matmul: a (M, K) and b (K, N) disagree on K")
    N = b.shape[1]
    c = np.empty((M, N), dtype=np.float32)  # (M, N)
    for i in range(M):
        for j in range(N):
            acc = np.float32(0.0)
            for k in range(K):
                acc += a[i, k] * b[k, j]  # b[k, j] is N floats away from b[k-1, j]
            c[i, j] = acc
    return c


@njit(cache=True)
def matmul_v2_streaming(a, b):
    """(M, K) @ (K, N) in i-k-j order: each step adds a scaled row of b to a row of c."""
    M, K = a.shape
    if b.shape[0] != K:
        raise ValueError("matmul: a (M, K) and b (K, N) disagree on K")
    N = b.shape[1]
    c = np.zeros((M, N), dtype=np.float32)  # (M, N)
    for i in range(M):
        for k in range(K):
            aik = a[i, k]
            for j in range(N):             # contiguous in b and c: one vector FMA per 16 floats
                c[i, j] += aik * b[k, j]
    return c


# -----------------------------------------------------------------------------
# v3 and v4: cache blocks and register tiles, on b packed transposed


@njit(cache=True, fastmath=True)
def _tile_4x4(a, bt, c, i, j):
    """c[i:i+4, j:j+4] = a[i:i+4] @ bt[j:j+4].T with the 16 sums in registers for the whole K loop.

    fastmath lets LLVM split each sum into vector lanes (a reordering of the additions), so the
    loop runs 16 vector FMAs per 8 vector loads.
    """
    s00 = s01 = s02 = s03 = np.float32(0.0)
    s10 = s11 = s12 = s13 = np.float32(0.0)
    s20 = s21 = s22 = s23 = np.float32(0.0)
    s30 = s31 = s32 = s33 = np.float32(0.0)
    for k in range(a.shape[1]):
        a0, a1, a2, a3 = a[i, k], a[i + 1, k], a[i + 2, k], a[i + 3, k]
        b0, b1, b2, b3 = bt[j, k], bt[j + 1, k], bt[j + 2, k], bt[j + 3, k]
        s00 += a0 * b0; s01 += a0 * b1; s02 += a0 * b2; s03 += a0 * b3  # noqa: E702
        s10 += a1 * b0; s11 += a1 * b1; s12 += a1 * b2; s13 += a1 * b3  # noqa: E702
        s20 += a2 * b0; s21 += a2 * b1; s22 += a2 * b2; s23 += a2 * b3  # noqa: E702
        s30 += a3 * b0; s31 += a3 * b1; s32 += a3 * b2; s33 += a3 * b3  # noqa: E702
    c[i, j], c[i, j + 1], c[i, j + 2], c[i, j + 3] = s00, s01, s02, s03
    c[i + 1, j], c[i + 1, j + 1], c[i + 1, j + 2], c[i + 1, j + 3] = s10, s11, s12, s13
    c[i + 2, j], c[i + 2, j + 1], c[i + 2, j + 2], c[i + 2, j + 3] = s20, s21, s22, s23
    c[i + 3, j], c[i + 3, j + 1], c[i + 3, j + 2], c[i + 3, j + 3] = s30, s31, s32, s33


@njit(cache=True, fastmath=True)
def _tile_2x4(a, bt, c, i, j):
    """c[i:i+2, j:j+4] = a[i:i+2] @ bt[j:j+4].T: the tile of _tile_4x4 cut to AVX2's 16 registers."""
    s00 = s01 = s02 = s03 = np.float32(0.0)
    s10 = s11 = s12 = s13 = np.float32(0.0)
    for k in range(a.shape[1]):
        a0, a1 = a[i, k], a[i + 1, k]
        b0, b1, b2, b3 = bt[j, k], bt[j + 1, k], bt[j + 2, k], bt[j + 3, k]
        s00 += a0 * b0; s01 += a0 * b1; s02 += a0 * b2; s03 += a0 * b3  # noqa: E702
        s10 += a1 * b0; s11 += a1 * b1; s12 += a1 * b2; s13 += a1 * b3  # noqa: E702
    c[i, j], c[i, j + 1], c[i, j + 2], c[i, j + 3] = s00, s01, s02, s03
    c[i + 1, j], c[i + 1, j + 1], c[i + 1, j + 2], c[i + 1, j + 3] = s10, s11, s12, s13


@njit(cache=True, fastmath=True)
def _tile_edge(a, bt, c, i0, i1, j0, j1):
    """The ragged border (fewer than TILE_ROWS rows or 4 columns left): one dot product per output."""
    for i in range(i0, i1):
        for j in range(j0, j1):
            acc = np.float32(0.0)
            for k in range(a.shape[1]):
                acc += a[i, k] * bt[j, k]
            c[i, j] = acc


@njit(cache=True, fastmath=True)
def _column_block(a, bt, c, j_lo, j_hi):
    """c[:, j_lo:j_hi] = a @ bt[j_lo:j_hi].T; bt[j_lo:j_hi] stays in L2 while a streams past."""
    M = a.shape[0]
    for i in range(0, M, TILE_ROWS):
        for j in range(j_lo, j_hi, TILE):
            if i + TILE_ROWS <= M and j + TILE <= j_hi:
                if TILE_ROWS == 4:  # a compile-time constant: the other branch is not generated
                    _tile_4x4(a, bt, c, i, j)
                else:
                    _tile_2x4(a, bt, c, i, j)
            else:
                _tile_edge(a, bt, c, i, min(i + TILE_ROWS, M), j, min(j + TILE, j_hi))


@njit(cache=True, fastmath=True)
def matmul_nt_serial(a, bt):
    """a (M, K) @ bt (N, K).T -> (M, N) on one core: the kernel of v3."""
    if a.shape[1] != bt.shape[1]:
        raise ValueError("matmul_nt: a (M, K) and bt (N, K) disagree on K")
    M, N = a.shape[0], bt.shape[0]
    c = np.empty((M, N), dtype=np.float32)  # (M, N)
    for j_lo in range(0, N, COLUMN_BLOCK):
        _column_block(a, bt, c, j_lo, min(j_lo + COLUMN_BLOCK, N))
    return c


@njit(cache=True, fastmath=True, parallel=True)
def matmul_nt_parallel(a, bt):
    """a (M, K) @ bt (N, K).T -> (M, N), column blocks spread over the cores: the kernel of v4 and linear."""
    if a.shape[1] != bt.shape[1]:
        raise ValueError("matmul_nt: a (M, K) and bt (N, K) disagree on K")
    M, N = a.shape[0], bt.shape[0]
    c = np.empty((M, N), dtype=np.float32)  # (M, N)
    n_blocks = (N + COLUMN_BLOCK - 1) // COLUMN_BLOCK
    for block in prange(n_blocks):
        j_lo = block * COLUMN_BLOCK
        _column_block(a, bt, c, j_lo, min(j_lo + COLUMN_BLOCK, N))
    return c


@njit(cache=True)
def pack_transposed(b):
    """b (K, N) -> bt (N, K), copied in 16 x 16 tiles so reads and writes both stay in cache lines.

    Three times faster than np.ascontiguousarray(b.T), which walks the output row by row and
    touches a new cache line of b for every element.
    """
    K, N = b.shape
    bt = np.empty((N, K), dtype=np.float32)  # (N, K)
    for k0 in range(0, K, 16):
        for j0 in range(0, N, 16):
            for k in range(k0, min(k0 + 16, K)):
                for j in range(j0, min(j0 + 16, N)):
                    bt[j, k] = b[k, j]
    return bt


def matmul_v3_blocked(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(M, K) @ (K, N): pack b transposed once (K*N copies, cheap next to M*N*K flops), then tiles."""
    return matmul_nt_serial(a, pack_transposed(b))  # (M, N)


def matmul_v4_parallel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(M, K) @ (K, N): v3 with the column blocks on every core."""
    return matmul_nt_parallel(a, pack_transposed(b))  # (M, N)


# -----------------------------------------------------------------------------
# the decode shape: one row against a weight matrix


@njit(cache=True, fastmath=True)
def _matvec_rows(x, w, y, o0, o1):
    """y[o0:o1] = w[o0:o1] @ x, eight rows at a time so each loaded x value feeds eight FMAs."""
    o = o0
    while o + 8 <= o1:
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
        for k in range(x.shape[0]):
            xk = x[k]
            s0 += w[o, k] * xk; s1 += w[o + 1, k] * xk; s2 += w[o + 2, k] * xk; s3 += w[o + 3, k] * xk  # noqa: E702
            s4 += w[o + 4, k] * xk; s5 += w[o + 5, k] * xk; s6 += w[o + 6, k] * xk; s7 += w[o + 7, k] * xk  # noqa: E702
        y[o], y[o + 1], y[o + 2], y[o + 3] = s0, s1, s2, s3
        y[o + 4], y[o + 5], y[o + 6], y[o + 7] = s4, s5, s6, s7
        o += 8
    for r in range(o, o1):
        acc = np.float32(0.0)
        for k in range(x.shape[0]):
            acc += w[r, k] * x[k]
        y[r] = acc


@njit(cache=True, fastmath=True, parallel=True)
def matvec(x, w):
    """w (N, K) @ x (K,) -> (N,): row blocks over the cores, each weight read once."""
    if x.shape[0] != w.shape[1]:
        raise ValueError("matvec: x (K,) and w (N, K) disagree on K")
    N = w.shape[0]
    y = np.empty(N, dtype=np.float32)  # (N,)
    n_blocks = (N + COLUMN_BLOCK - 1) // COLUMN_BLOCK
    for block in prange(n_blocks):
        o0 = block * COLUMN_BLOCK
        _matvec_rows(x, w, y, o0, min(o0 + COLUMN_BLOCK, N))
    return y
