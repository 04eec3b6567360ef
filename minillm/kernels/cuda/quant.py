"""Block-quantized weights on the GPU: the fused matvec that decode runs, and dequantize for prefill.

The packed GGUF bytes go to the GPU as they are, (rows, cols // 32 * block_bytes) uint8. Every
block starts with its fp16 scale (and Q4_1 with its fp16 min) at an even byte offset, so a float16
view of the same memory reads them: `float32(halves[row, offset // 2])` converts in hardware.

    Q8_0  34 bytes = d + 32 x int8 q                 w = q * d
    Q4_0  18 bytes = d + 16 bytes of nibbles         w = (q - 8) * d
    Q4_1  20 bytes = d + m + 16 bytes of nibbles     w = q * d + m
    (byte j of the nibbles: weight j in the low 4 bits, weight j + 16 in the high 4 bits)

Decode (T tokens, 1 <= T <= 8): `qmatvec_kernel`, one warp per output row for all T tokens. Lane j
handles weight j of every block of the row, so a warp consumes one block per step: the block's
16-34 bytes (lanes j and j + 16 share byte j: a broadcast), decoded once into a register and
multiplied into T accumulators, with 32 consecutive floats of each token's x (coalesced). The fp32
weights never exist in memory, and each packed weight is read once per step whatever T is - the
whole point, since decode's speed is bytes read per step, and Q4_1 is 5 bits per weight against
fp32's 32.

Prefill (many tokens): compute-bound, so each weight must serve many tokens. `qlinear_tiled_kernel`
is the tiled matmul of matmul_ladder.py with one change: the thread that stages a weight into the
shared-memory tile decodes it from the packed bytes on the way in. No fp32 copy of the matrix is
ever written to DRAM; each tile of W is decoded once per TILE tokens.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32

from minillm.kernels.cuda.basics import warp_sum
from minillm.kernels.cuda.matmul_ladder import PADDED_TILE, TILE
from minillm.kernels.cuda.setup import WARP, blocks_for, empty_gpu, launch, threads_for, to_gpu, to_host
from minillm.kernels.quant_formats import QMatrix

Q8_0, Q4_0, Q4_1 = 0, 1, 2
QTYPE_CODES = {"Q8_0": Q8_0, "Q4_0": Q4_0, "Q4_1": Q4_1}
QMATVEC_MAX_T = 8  # up to this many tokens: the fused matvec; beyond, the tiled kernel
QMATVEC_WARPS = 4  # rows per block


# -----------------------------------------------------------------------------------------------
# One weight, decoded from the packed bytes. The qtype is the same in every thread: a uniform
# branch, so it costs no divergence.


@cuda.jit(device=True)
def quantized_weight(data, halves, qtype, row, col):
    """w[row, col] from data (rows, nbytes) uint8 and halves, its float16 view (rows, nbytes // 2)."""
    block, j = col // 32, col % 32
    if qtype == Q8_0:
        base = block * 34
        q = int32(data[row, base + 2 + j])
        if q > 127:  # the byte is an int8
            q -= 256
        return float32(q) * float32(halves[row, base // 2])
    if qtype == Q4_0:
        base, first_nibble = block * 18, 2
    else:
        base, first_nibble = block * 20, 4
    byte = data[row, base + first_nibble + j % 16]
    q = int32(byte & 0x0F) if j < 16 else int32(byte >> 4)
    d = float32(halves[row, base // 2])
    if qtype == Q4_0:
        return float32(q - 8) * d
    return float32(q) * d + float32(halves[row, base // 2 + 1])  # Q4_1: + m


# -----------------------------------------------------------------------------------------------
# Decode: the fused quantized matvec


@cuda.jit
def qmatvec_kernel(x, data, halves, qtype, out):
    """x (T, cols), T <= QMATVEC_MAX_T -> out (T, rows); block i: rows i*QMATVEC_WARPS.., a warp each."""
    row = cuda.blockIdx.x * QMATVEC_WARPS + cuda.threadIdx.x // WARP
    lane = cuda.threadIdx.x % WARP
    if row >= out.shape[1]:
        return  # the whole warp leaves together
    T = x.shape[0]
    acc = cuda.local.array(QMATVEC_MAX_T, float32)  # (T,) one running dot product per token
    for t in range(T):
        acc[t] = float32(0.0)
    for block in range(x.shape[1] // 32):
        col = block * 32 + lane
        w = quantized_weight(data, halves, qtype, row, col)  # decoded once, used T times
        for t in range(T):
            acc[t] += w * x[t, col]
    for t in range(T):
        total = warp_sum(acc[t])
        if lane == 0:
            out[t, row] = total


# -----------------------------------------------------------------------------------------------
# Prefill: tiles of x and of W in shared memory, W decoded as it is staged (see matmul_ladder.py's
# linear_tiled_kernel for the tiling; the padded column avoids shared-memory bank conflicts).


@cuda.jit
def qlinear_tiled_kernel(x, data, halves, qtype, out):
    """x (T, cols) -> out (T, rows) = x @ W.T; block (i, j): a TILE x TILE tile of out."""
    x_tile = cuda.shared.array((TILE, TILE), float32)
    w_tile = cuda.shared.array((TILE, PADDED_TILE), float32)  # w_tile[k, o], padded
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    row = cuda.blockIdx.y * TILE + ty  # token
    col = cuda.blockIdx.x * TILE + tx  # output feature
    T, K = x.shape
    N = out.shape[1]
    w_row = cuda.blockIdx.x * TILE + ty  # the row of W this thread decodes into the tile
    acc = float32(0.0)
    for k0 in range(0, K, TILE):  # K is a multiple of 32, so of TILE: no partial tile along K
        x_tile[ty, tx] = x[row, k0 + tx] if row < T else float32(0.0)
        w_tile[tx, ty] = quantized_weight(data, halves, qtype, w_row, k0 + tx) if w_row < N else float32(0.0)
        cuda.syncthreads()
        for k in range(TILE):
            acc += x_tile[ty, k] * w_tile[k, tx]
        cuda.syncthreads()
    if row < T and col < N:
        out[row, col] = acc


# -----------------------------------------------------------------------------------------------
# Prefill and embeddings: decode whole rows


@cuda.jit
def dequantize_kernel(data, halves, qtype, out):
    col, row = cuda.grid(2)  # neighbouring threads, neighbouring columns: coalesced writes
    if row < out.shape[0] and col < out.shape[1]:
        out[row, col] = quantized_weight(data, halves, qtype, row, col)


@cuda.jit
def qembedding_kernel(ids, data, halves, qtype, out):
    t = cuda.blockIdx.x  # one block per token; only the rows named are decoded
    for col in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
        out[t, col] = quantized_weight(data, halves, qtype, ids[t], col)


# -----------------------------------------------------------------------------------------------
# Host side


class GPUQMatrix:
    """A QMatrix's packed bytes on the GPU, with the float16 view of the same memory."""

    def __init__(self, qtype: str, shape: tuple[int, int], data):
        self.qtype, self.shape = qtype, shape  # (rows, cols)
        self.code = QTYPE_CODES[qtype]
        self.data = data  # (rows, cols // 32 * block_bytes) uint8 device array
        self.halves = data.view(np.float16)  # (rows, cols // 32 * block_bytes // 2), no copy

    @classmethod
    def upload(cls, qm: QMatrix) -> GPUQMatrix:
        """Copy the packed bytes to the device, as they are (one copy, at load)."""
        return cls(qm.qtype, qm.shape, to_gpu(qm.data, np.uint8))

    def rows(self, first: int, last: int) -> GPUQMatrix:
        """Rows first..last-1, a view of the same device memory (no copy)."""
        return GPUQMatrix(self.qtype, (last - first, self.shape[1]), self.data[first:last])

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


DEQUANT_BLOCK = 16


def dequantize_gpu(qm: GPUQMatrix):
    """-> (rows, cols) float32 device array."""
    rows, cols = qm.shape
    out = empty_gpu((rows, cols))  # (rows, cols)
    grid = (blocks_for(cols, DEQUANT_BLOCK), blocks_for(rows, DEQUANT_BLOCK))
    launch(dequantize_kernel[grid, (DEQUANT_BLOCK, DEQUANT_BLOCK)], qm.data, qm.halves, qm.code, out)
    return out


def qlinear_gpu(x, qm: GPUQMatrix):
    """x (T, cols) device array -> (T, rows) device array = x @ W.T."""
    T, rows = x.shape[0], qm.shape[0]
    out = empty_gpu((T, rows))  # (T, rows)
    if T <= QMATVEC_MAX_T:
        launch(qmatvec_kernel[blocks_for(rows, QMATVEC_WARPS), QMATVEC_WARPS * WARP], x, qm.data, qm.halves, qm.code, out)
    else:
        grid = (blocks_for(rows, TILE), blocks_for(T, TILE))
        launch(qlinear_tiled_kernel[grid, (TILE, TILE)], x, qm.data, qm.halves, qm.code, out)
    return out


def qembedding_gpu(ids, qm: GPUQMatrix):
    """ids (T,) int64 device array -> (T, cols) float32 device array (ids must be in range)."""
    out = empty_gpu((ids.shape[0], qm.shape[1]))  # (T, cols)
    launch(qembedding_kernel[ids.shape[0], threads_for(qm.shape[1])], ids, qm.data, qm.halves, qm.code, out)
    return out


def _check_qmatrix(qm: QMatrix) -> None:
    if not isinstance(qm, QMatrix):
        raise ValueError(f"expected a QMatrix, got {type(qm).__name__}")


def _check_input(x: np.ndarray, qm: QMatrix, ndim: int) -> None:
    if x.ndim != ndim or x.shape[-1] != qm.shape[1]:
        want = "(cols,)" if ndim == 1 else "(T, cols)"
        raise ValueError(f"x must be {want} with cols = {qm.shape[1]} for a {qm!r}, got shape {x.shape}")


def dequantize(qm: QMatrix) -> np.ndarray:
    """QMatrix -> (rows, cols) float32, decoded on the GPU."""
    _check_qmatrix(qm)
    return to_host(dequantize_gpu(GPUQMatrix.upload(qm)))


def qmatvec(x: np.ndarray, qm: QMatrix) -> np.ndarray:
    """x (cols,) -> (rows,) = W @ x, straight from the packed blocks."""
    _check_qmatrix(qm)
    _check_input(x, qm, 1)
    return to_host(qlinear_gpu(to_gpu(x[None]), GPUQMatrix.upload(qm)))[0]


def qlinear(x: np.ndarray, qm: QMatrix) -> np.ndarray:
    """x (T, cols) -> (T, rows) = x @ W.T: the fused matvec for T <= QMATVEC_MAX_T, else the tiled kernel."""
    _check_qmatrix(qm)
    _check_input(x, qm, 2)
    return to_host(qlinear_gpu(to_gpu(x), GPUQMatrix.upload(qm)))


def qembedding(ids: np.ndarray, qm: QMatrix) -> np.ndarray:
    """ids (T,) int -> (T, cols) float32: only the rows the ids name are decoded."""
    _check_qmatrix(qm)
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)  # (T,)
    if ids.size and (ids.min() < 0 or ids.max() >= qm.shape[0]):
        bad = ids[(ids < 0) | (ids >= qm.shape[0])][0]
        raise IndexError(f"token id {bad} is out of range for an embedding table of {qm.shape[0]} rows")
    return to_host(qembedding_gpu(to_gpu(ids, np.int64), GPUQMatrix.upload(qm)))
