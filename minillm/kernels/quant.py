"""Block-quantized weights: the Q8_0, Q4_0 and Q4_1 formats of GGUF, and the operators that use them.

A quantized weight matrix is cut, along each row, into blocks of 32 weights. Each block stores a
float16 scale (and, for Q4_1, a float16 minimum) followed by 32 small integers:

    Q8_0  34 bytes = d (fp16) + 32 x int8 q                        w = q * d
    Q4_0  18 bytes = d (fp16) + 16 bytes of nibbles, q in 0..15    w = (q - 8) * d
    Q4_1  20 bytes = d (fp16) + m (fp16) + 16 bytes of nibbles     w = q * d + m

In the 4-bit formats, byte j of the nibbles holds weight j in its low 4 bits and weight j + 16 in
its high 4 bits (the two halves of the block, not neighbours).

Three tiers, as everywhere in minillm:
- `dequantize_reference` and `qlinear_reference`: NumPy, written to be read - the specification.
- `dequantize`, `qmatvec`, `qmatmul`, `qembedding`: Numba kernels. Decode is memory-bound, so the
  matvec reads each packed byte exactly once and never writes fp32 weights anywhere; a batch is
  compute-bound, so `qmatmul` decodes a tile of weights into cache once and reuses it T times.
- `qlinear`: the dispatch the model calls (see its docstring for the rule).

fp16 scales are converted to fp32 exactly; every dot product accumulates in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
from numba import njit, prange

from minillm.kernels.cpu_matmul import matmul_nt_into

# -----------------------------------------------------------------------------------------------
# The formats

BLOCK_SIZE = 32  # weights per block, in every format here
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
QTYPES = tuple(BLOCK_BYTES)


@dataclass(frozen=True, eq=False)
class QMatrix:
    """A (rows, cols) weight matrix in a block format; `data` holds the GGUF bytes, row-major.

    data: uint8 (rows, cols // 32 * block_bytes) - when read from a file, a zero-copy view of it.
    """

    qtype: str
    shape: tuple[int, int]
    data: np.ndarray

    def __post_init__(self):
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"unknown block format {self.qtype!r}; supported: {', '.join(QTYPES)}")
        rows, cols = self.shape
        if cols % BLOCK_SIZE:
            raise ValueError(f"{self.qtype} rows must be a multiple of {BLOCK_SIZE} long, got shape {self.shape}")
        expected = (rows, cols // BLOCK_SIZE * BLOCK_BYTES[self.qtype])
        if self.data.dtype != np.uint8 or self.data.shape != expected:
            raise ValueError(
                f"{self.qtype} data for shape {self.shape} must be uint8 {expected}, "
                f"got {self.data.dtype} {self.data.shape}"
            )
        object.__setattr__(self, "shape", (int(rows), int(cols)))

    @property
    def nbytes(self) -> int:
        """Packed bytes - what a matvec must read."""
        return self.data.nbytes

    @property
    def bits_per_weight(self) -> float:
        return 8 * BLOCK_BYTES[self.qtype] / BLOCK_SIZE

    def dequantize(self) -> np.ndarray:
        return dequantize(self)

    def __repr__(self):
        return f"QMatrix({self.qtype}, shape={self.shape}, {self.nbytes:,} bytes)"


# -----------------------------------------------------------------------------------------------
# Quantize: round-to-nearest, exactly as ggml's reference quantizers (ggml-quants.c) do it, all in
# float32 arithmetic, so our bytes equal llama.cpp's and the `gguf` package's.

def quantize(w: np.ndarray, qtype: str) -> QMatrix:
    """w (rows, cols) float32, cols % 32 == 0 -> QMatrix in `qtype`."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"quantize expects a 2-D (rows, cols) matrix, got shape {w.shape}")
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"unknown block format {qtype!r}; supported: {', '.join(QTYPES)}")
    rows, cols = w.shape
    if cols % BLOCK_SIZE:
        raise ValueError(f"quantize needs rows that are a multiple of {BLOCK_SIZE} long, got shape {w.shape}")
    blocks = w.astype(np.float32).reshape(-1, BLOCK_SIZE)  # (n_blocks, 32)
    packed = {"Q8_0": _quantize_q8_0, "Q4_0": _quantize_q4_0, "Q4_1": _quantize_q4_1}[qtype](blocks)
    return QMatrix(qtype, (rows, cols), packed.reshape(rows, -1))  # (rows, cols // 32 * block_bytes)


def _inverse(d: np.ndarray) -> np.ndarray:
    """1/d, and 0 where d == 0 (an all-zero block), in float32."""
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _fp16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8)  # (n_blocks, 2), round-to-nearest-even


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """q (n_blocks, 32) in 0..15 -> (n_blocks, 16): byte j = q[j] | q[j + 16] << 4."""
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def _quantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)  # (n_blocks, 1)
    scaled = blocks * _inverse(d)  # (n_blocks, 32) in [-127, 127]
    q = np.sign(scaled) * np.floor(np.abs(scaled) + np.float32(0.5))  # C roundf: halves away from 0
    return np.concatenate([_fp16_bytes(d), q.astype(np.int8).view(np.uint8)], axis=1)  # (n_blocks, 34)


def _quantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    # The scale carries the sign of the largest-magnitude weight, which lands exactly on q = 0.
    signed_max = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)  # (n_blocks, 1)
    d = signed_max / np.float32(-8)
    q = np.minimum(np.trunc(blocks * _inverse(d) + np.float32(8.5)), 15).astype(np.uint8)  # (n_blocks, 32)
    return np.concatenate([_fp16_bytes(d), _pack_nibbles(q)], axis=1)  # (n_blocks, 18)


def _quantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    lo = blocks.min(axis=1, keepdims=True)  # (n_blocks, 1)
    d = (blocks.max(axis=1, keepdims=True) - lo) / np.float32(15)
    q = np.minimum(np.trunc((blocks - lo) * _inverse(d) + np.float32(0.5)), 15).astype(np.uint8)  # (n_blocks, 32)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(lo), _pack_nibbles(q)], axis=1)  # (n_blocks, 20)


# -----------------------------------------------------------------------------------------------
# Dequantize, the reference: NumPy, one format per function, read it as the spec

def _blocks(data: np.ndarray, rows: int, cols: int, qtype: str) -> np.ndarray:
    n_blocks = rows * cols // BLOCK_SIZE
    return np.ascontiguousarray(data, dtype=np.uint8).reshape(n_blocks, BLOCK_BYTES[qtype])


def _fp16(two_bytes: np.ndarray) -> np.ndarray:
    """(n_blocks, 2) little-endian fp16 bytes -> (n_blocks, 1) float32 (exact)."""
    return np.ascontiguousarray(two_bytes).view(np.float16).astype(np.float32)


def _unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """(n_blocks, 16) bytes -> (n_blocks, 32) in 0..15: low nibbles are weights 0..15, high 16..31."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=1)


def dequantize_q8_0(data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Q8_0 bytes (rows, cols // 32 * 34) -> (rows, cols) float32."""
    blocks = _blocks(data, rows, cols, "Q8_0")  # (n_blocks, 34)
    d = _fp16(blocks[:, 0:2])  # (n_blocks, 1)
    q = blocks[:, 2:].view(np.int8).astype(np.float32)  # (n_blocks, 32)
    return (q * d).reshape(rows, cols)


def dequantize_q4_0(data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Q4_0 bytes (rows, cols // 32 * 18) -> (rows, cols) float32."""
    blocks = _blocks(data, rows, cols, "Q4_0")  # (n_blocks, 18)
    d = _fp16(blocks[:, 0:2])  # (n_blocks, 1)
    q = _unpack_nibbles(blocks[:, 2:]).astype(np.float32)  # (n_blocks, 32)
    return ((q - 8) * d).reshape(rows, cols)


def dequantize_q4_1(data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Q4_1 bytes (rows, cols // 32 * 20) -> (rows, cols) float32."""
    blocks = _blocks(data, rows, cols, "Q4_1")  # (n_blocks, 20)
    d = _fp16(blocks[:, 0:2])  # (n_blocks, 1)
    m = _fp16(blocks[:, 2:4])  # (n_blocks, 1)
    q = _unpack_nibbles(blocks[:, 4:]).astype(np.float32)  # (n_blocks, 32)
    return (q * d + m).reshape(rows, cols)


_DEQUANTIZE_REFERENCE = {"Q8_0": dequantize_q8_0, "Q4_0": dequantize_q4_0, "Q4_1": dequantize_q4_1}


def dequantize_reference(qm: QMatrix) -> np.ndarray:
    """QMatrix -> (rows, cols) float32, in NumPy."""
    rows, cols = qm.shape
    return _DEQUANTIZE_REFERENCE[qm.qtype](qm.data, rows, cols)


def qlinear_reference(x: np.ndarray, qm: QMatrix) -> np.ndarray:
    """x (T, cols) -> (T, rows) = x @ W.T with W dequantized first."""
    return np.asarray(x, dtype=np.float32) @ dequantize_reference(qm).T


# -----------------------------------------------------------------------------------------------
# Numba building blocks: an fp16 scale read from two bytes, one row decoded into fp32

# 2^(e - 25) for each fp16 exponent e (and 2^-24 for e = 0, the subnormals), exact in float32:
# an fp16 with exponent e and mantissa m is (1024 + m) * 2^(e - 25), or m * 2^-24 when e == 0.
_FP16_STEP = np.array([2.0**-24] + [2.0 ** (e - 25) for e in range(1, 32)], dtype=np.float32)


@njit(cache=True, inline="always")
def _f16(lo, hi):
    """Two little-endian bytes of an IEEE fp16 -> float32, exactly (subnormals, inf and nan too)."""
    bits = np.int32(lo) | (np.int32(hi) << 8)
    exponent = (bits >> 10) & 0x1F
    mantissa = bits & 0x3FF
    if exponent == 31:
        magnitude = np.float32(np.inf) if mantissa == 0 else np.float32(np.nan)
    else:
        magnitude = np.float32(mantissa + (1024 if exponent else 0)) * _FP16_STEP[exponent]
    return -magnitude if bits & 0x8000 else magnitude


@njit(cache=True, inline="always")
def _low_nibble(byte):
    """Weight j of a 4-bit block (byte j's low 4 bits) as float32. The uint8 arithmetic matters:
    Numba would widen `byte & 15` to int64, and the SIMD lanes with it (15-40% slower here)."""
    return np.float32(np.uint8(byte & np.uint8(0x0F)))


@njit(cache=True, inline="always")
def _high_nibble(byte):
    """Weight j + 16 of a 4-bit block (byte j's high 4 bits) as float32."""
    return np.float32(np.uint8(byte >> np.uint8(4)))


# The loops below run over slices (`nibbles`, `low`, `high`) rather than `range(16)`: a trip count
# known only at run time goes to LLVM's loop vectoriser, which checks once that `out` and `row`
# don't overlap and then converts 16 weights per instruction. With a constant 16 the loop is
# unrolled first into scalar loads and stores that nothing proves independent, so they stay
# scalar - 2-3x slower (measured on a Q4_1 1536 x 576 matrix: 430 -> 190 us on one core).

@njit(cache=True, inline="always")
def _decode_row_q8_0(row, out):
    """One row of Q8_0 blocks (uint8) -> out (cols,) float32."""
    for b in range(out.shape[0] // 32):
        o = b * 34
        d = _f16(row[o], row[o + 1])
        quants, dst = row[o + 2:o + 34], out[b * 32:b * 32 + 32]  # (32,) each
        for j in range(quants.shape[0]):
            dst[j] = np.float32(np.int8(quants[j])) * d  # the byte is an int8


@njit(cache=True, inline="always")
def _decode_row_q4_0(row, out):
    for b in range(out.shape[0] // 32):
        o = b * 18
        d = _f16(row[o], row[o + 1])
        nibbles = row[o + 2:o + 18]                                           # (16,)
        low, high = out[b * 32:b * 32 + 16], out[b * 32 + 16:b * 32 + 32]    # (16,) each
        for j in range(nibbles.shape[0]):
            low[j] = (_low_nibble(nibbles[j]) - np.float32(8.0)) * d
            high[j] = (_high_nibble(nibbles[j]) - np.float32(8.0)) * d


@njit(cache=True, inline="always")
def _decode_row_q4_1(row, out):
    for b in range(out.shape[0] // 32):
        o = b * 20
        d = _f16(row[o], row[o + 1])
        m = _f16(row[o + 2], row[o + 3])
        nibbles = row[o + 4:o + 20]                                           # (16,)
        low, high = out[b * 32:b * 32 + 16], out[b * 32 + 16:b * 32 + 32]    # (16,) each
        for j in range(nibbles.shape[0]):
            low[j] = _low_nibble(nibbles[j]) * d + m
            high[j] = _high_nibble(nibbles[j]) * d + m


Q8_0_CODE, Q4_0_CODE, Q4_1_CODE = 0, 1, 2
_CODES = {"Q8_0": Q8_0_CODE, "Q4_0": Q4_0_CODE, "Q4_1": Q4_1_CODE}


@njit(cache=True, inline="always")
def _decode_row(code, row, out):
    if code == Q8_0_CODE:
        _decode_row_q8_0(row, out)
    elif code == Q4_0_CODE:
        _decode_row_q4_0(row, out)
    else:
        _decode_row_q4_1(row, out)


# -----------------------------------------------------------------------------------------------
# Dequantize (Numba) and the quantized embedding lookup

@njit(cache=True, parallel=True)
def _dequantize_rows(code, data, out):
    for r in prange(out.shape[0]):
        _decode_row(code, data[r], out[r])


def dequantize(qm: QMatrix) -> np.ndarray:
    """QMatrix -> (rows, cols) float32, parallel over rows."""
    out = np.empty(qm.shape, dtype=np.float32)  # (rows, cols)
    _dequantize_rows(_CODES[qm.qtype], qm.data, out)
    return out


@njit(cache=True, parallel=True)
def _gather_rows(code, data, ids, out):
    for t in prange(ids.shape[0]):
        _decode_row(code, data[ids[t]], out[t])


def qembedding(ids: np.ndarray, qm: QMatrix) -> np.ndarray:
    """ids (T,) int -> (T, cols) float32: decodes only the rows the ids name (a quantized token_embd)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)  # (T,)
    if ids.size and (ids.min() < 0 or ids.max() >= qm.shape[0]):
        bad = ids[(ids < 0) | (ids >= qm.shape[0])][0]
        raise IndexError(f"token id {bad} is out of range for an embedding table of {qm.shape[0]} rows")
    out = np.empty((ids.shape[0], qm.shape[1]), dtype=np.float32)  # (T, cols)
    _gather_rows(_CODES[qm.qtype], qm.data, ids, out)
    return out


# -----------------------------------------------------------------------------------------------
# Fused matvec: each packed byte read once, decoded in registers, multiplied straight into x
#
# The 32 products of a block are not summed on the spot (a horizontal add per block is slow);
# each of the 32 positions keeps its own running sum across the row's blocks - 32 independent
# lanes the compiler turns into SIMD registers - and the lanes are added once, at the row's end.

ROWS_PER_TASK = 16  # rows one parallel task handles (each task owns its lane accumulators)


@njit(cache=True, parallel=True, fastmath=True)
def _qmatvec_q8_0(data, x, out):
    rows, n_blocks = out.shape[0], x.shape[0] // 32
    for task in prange((rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        lanes = np.empty(32, dtype=np.float32)  # (32,) running sums, one per block position
        for r in range(task * ROWS_PER_TASK, min(rows, (task + 1) * ROWS_PER_TASK)):
            row = data[r]
            lanes[:] = 0.0
            for b in range(n_blocks):
                o = b * 34
                d = _f16(row[o], row[o + 1])
                for j in range(32):
                    lanes[j] += np.float32(np.int8(row[o + 2 + j])) * d * x[b * 32 + j]
            out[r] = lanes.sum()


@njit(cache=True, parallel=True, fastmath=True)
def _qmatvec_q4_0(data, x, out):
    rows, n_blocks = out.shape[0], x.shape[0] // 32
    for task in prange((rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        lanes = np.empty(32, dtype=np.float32)  # (32,)
        for r in range(task * ROWS_PER_TASK, min(rows, (task + 1) * ROWS_PER_TASK)):
            row = data[r]
            lanes[:] = 0.0
            for b in range(n_blocks):
                o = b * 18
                d = _f16(row[o], row[o + 1])
                for j in range(16):
                    byte = row[o + 2 + j]
                    lanes[j] += (_low_nibble(byte) - np.float32(8.0)) * d * x[b * 32 + j]
                    lanes[j + 16] += (_high_nibble(byte) - np.float32(8.0)) * d * x[b * 32 + j + 16]
            out[r] = lanes.sum()


@njit(cache=True, parallel=True, fastmath=True)
def _qmatvec_q4_1(data, x, out):
    rows, n_blocks = out.shape[0], x.shape[0] // 32
    for task in prange((rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        lanes = np.empty(32, dtype=np.float32)  # (32,)
        for r in range(task * ROWS_PER_TASK, min(rows, (task + 1) * ROWS_PER_TASK)):
            row = data[r]
            lanes[:] = 0.0
            for b in range(n_blocks):
                o = b * 20
                d = _f16(row[o], row[o + 1])
                m = _f16(row[o + 2], row[o + 3])
                for j in range(16):
                    byte = row[o + 4 + j]
                    lanes[j] += (_low_nibble(byte) * d + m) * x[b * 32 + j]
                    lanes[j + 16] += (_high_nibble(byte) * d + m) * x[b * 32 + j + 16]
            out[r] = lanes.sum()


_QMATVEC = {"Q8_0": _qmatvec_q8_0, "Q4_0": _qmatvec_q4_0, "Q4_1": _qmatvec_q4_1}


def _check_input(x: np.ndarray, qm: QMatrix, ndim: int) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != ndim or x.shape[-1] != qm.shape[1]:
        want = "(cols,)" if ndim == 1 else "(T, cols)"
        raise ValueError(f"x must be {want} with cols = {qm.shape[1]} for a {qm!r}, got shape {x.shape}")
    return x


def qmatvec(x: np.ndarray, qm: QMatrix) -> np.ndarray:
    """x (cols,) -> (rows,) = W @ x, straight from the packed blocks (decode: T == 1)."""
    x = _check_input(x, qm, 1)  # (cols,)
    out = np.empty(qm.shape[0], dtype=np.float32)  # (rows,)
    _QMATVEC[qm.qtype](qm.data, x, out)
    return out


# -----------------------------------------------------------------------------------------------
# Batched matmul: dequantize a tile of rows into an L2-sized scratch, multiply it by all T rows
#
# Each weight is decoded once per call, whatever T is, and then feeds T FMAs from cache, so the
# decode cost (~0.2 ns a weight) is shared by the batch while the multiply runs at register-tiled
# matmul speed (cpu_matmul.py). Each parallel task owns one scratch tile for all its row tiles.

TILE_ROWS = 64  # rows of W per tile: 64 x 576 floats = 147 KB, in L2 next to the activations


@njit(cache=True, parallel=True, fastmath=True)
def _qmatmul(code, data, x, out, n_tasks):
    rows, cols = out.shape[1], x.shape[1]
    n_tiles = (rows + TILE_ROWS - 1) // TILE_ROWS
    for task in prange(n_tasks):
        tile = np.empty((TILE_ROWS, cols), dtype=np.float32)  # (TILE_ROWS, cols) this task's scratch
        for t in range(task * n_tiles // n_tasks, (task + 1) * n_tiles // n_tasks):
            first, n = t * TILE_ROWS, min(TILE_ROWS, rows - t * TILE_ROWS)
            for i in range(n):
                _decode_row(code, data[first + i], tile[i])
            matmul_nt_into(x, tile[:n], out[:, first:first + n])  # (T, n) = x @ tile.T


def qmatmul(x: np.ndarray, qm: QMatrix) -> np.ndarray:
    """x (T, cols) -> (T, rows) = x @ W.T; each packed weight is read and decoded once for all T rows."""
    x = _check_input(x, qm, 2)  # (T, cols)
    out = np.empty((x.shape[0], qm.shape[0]), dtype=np.float32)  # (T, rows)
    _qmatmul(_CODES[qm.qtype], qm.data, x, out, numba.get_num_threads())
    return out


# -----------------------------------------------------------------------------------------------
# The dispatch the model calls

# Where each path wins (benchmarks/quant_matvec.py, "batched"; 2-core Zen 4, two threads, one
# matrix in cache, microseconds; the committed figures are in benchmarks/results/quant_matvec.json):
#
#   Q4_1 1536 x 576 (ffn gate/up)   T = 1     2     3     4     8    16    64
#   qmatvec, row by row                60   113   265   333   640  1336  5626
#   qmatmul                           148   227   241   164   256   328   798
#   BLAS on fp32 weights               31   324   274   324   293   414   817
#
# The fused matvec streams the packed bytes at memory speed, so running it once per row wins
# while T is tiny although it reads the weights T times; from T = 4 qmatmul's single decode plus
# register-tiled FMAs wins, by 7x at T = 64 (142 GFLOP/s, level with BLAS on fp32 weights). T = 3
# is a toss-up (no full 4 x 4 register tile fits; the ragged edge runs one dot product per output).
MATVEC_ROWS_MAX_T = 3


def qlinear(x: np.ndarray, qm: QMatrix) -> np.ndarray:
    """x (T, cols) -> (T, rows) = x @ W.T, choosing the kernel by T:

    - T <= MATVEC_ROWS_MAX_T (decode of one or two streams): `qmatvec` once per row. It reads the
      packed bytes once per row but runs at memory speed; a row's result does not depend on the
      other rows.
    - larger T (decode batches, prefill): `qmatmul`, each weight decoded once for all T rows and
      multiplied with register tiles. Not BLAS: its thread pool and Numba's would fight over the
      cores inside a forward (cpu.py).
    The table above MATVEC_ROWS_MAX_T has the measurements behind the threshold.
    """
    x = _check_input(x, qm, 2)  # (T, cols)
    if x.shape[0] == 0:
        return np.empty((0, qm.shape[0]), dtype=np.float32)
    if x.shape[0] <= MATVEC_ROWS_MAX_T:
        return np.stack([qmatvec(row, qm) for row in x])  # (T, rows)
    return qmatmul(x, qm)  # (T, rows)
