"""Block-quantized weights: the operators that read them, and the dispatch the model calls.

The formats (Q8_0, Q4_0, Q4_1), the quantizers and the NumPy reference live in quant_formats.py
(re-exported here: ``quant.QMatrix``, ``quant.dequantize_reference``, ...). The tiers:
- `dequantize_reference` (here) and `reference.qlinear` / `reference.qembedding`: NumPy, written
  to be read - the specification.
- `dequantize`, `qmatvec`, `qmatmul`, `qembedding`: Numba kernels on the GGUF bytes. Decode is
  memory-bound, so the matvec reads each packed byte exactly once and never writes fp32 weights
  anywhere; a batch is compute-bound, so `qmatmul` decodes a tile of weights into cache once and
  reuses it T times.
- the SIMD kernels on weights repacked at load time (`RepackedMatrix`, cpu/quant_repack.py): exact
  fp32 activations (cpu/quant_fp32.py) or opt-in int8 activations (cpu/quant_int8.py). `qmatvec` and
  `qlinear` take either kind of matrix.
- `qlinear`: the dispatch the model calls (see its docstring for the rule).

fp16 scales are converted to fp32 exactly; in fp32 mode every dot product accumulates in fp32.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from minillm.kernels.cpu import quant_fp32
from minillm.kernels.cpu import quant_int8
from minillm.kernels.quant_formats import (  # noqa: F401 - the public names, and two chapter 04 shows
    BLOCK_BYTES, BLOCK_SIZE, QTYPES, QMatrix, _quantize_q4_1, _unpack_nibbles, dequantize_q4_0,
    dequantize_q4_1, dequantize_q8_0, dequantize_reference, quantize,
)
from minillm.kernels.cpu.quant_llvm import hot_loop_asm
from minillm.kernels.cpu.quant_matmul import (NT, NT_NARROW, WR, WR_NARROW, decode_repacked_rows, repacked_layout,
                                              weight_rows_tile)
from minillm.kernels.cpu.quant_repack import RepackedMatrix, repack

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
    """x (cols,) -> (rows,) = W @ x, straight from the packed blocks (decode: T == 1); a
    RepackedMatrix goes to its SIMD kernel, fp32 (exact) or int8 as it was repacked for."""
    return _matvec_checked(_check_input(x, qm, 1), qm)  # (rows,)


def _matvec_checked(x: np.ndarray, qm: QMatrix) -> np.ndarray:
    """qmatvec on an x already checked and contiguous: qlinear's decode path calls it ~120 times a
    step, and a second check there cost ~7 us a call (~0.85 ms of a decode step)."""
    if isinstance(qm, RepackedMatrix):
        return (quant_int8 if qm.activations == "int8" else quant_fp32).matvec(x, qm)  # (rows,)
    out = np.empty(qm.shape[0], dtype=np.float32)  # (rows,)
    _QMATVEC[qm.qtype](qm.data, x, out)
    return out


# -----------------------------------------------------------------------------------------------
# Batched matmul: decode a tile of rows into cache once, multiply it by all T rows
#
# Each weight is decoded once per call, whatever T is, and then feeds T FMAs from cache, so the
# decode is shared by the batch while the multiply runs in register blocks (cpu/quant_matmul.py,
# where the layouts are explained). A RepackedMatrix decodes with vector loads, a plain QMatrix row
# by row from its GGUF bytes. Each parallel task owns one tile (and its result) for all its tiles.

TILE_ROWS = 48  # rows of W per tile, a multiple of R and of WR: 48 x 576 floats = 110 KB, in L2
K_CHUNK = 192   # k per register-block pass: 192 x NT activations (24 KB on AVX-512) + WR weight rows stay in L1


@njit(cache=True, parallel=True)
def _qmatmul(code, data, quants, scales, mins, rows_per_group, layout, x_panels, out, n_tasks):
    """out (T, rows) = x @ W.T from x in panels (T padded / lanes, cols, lanes), lanes NT or (one
    panel) NT_NARROW. W: a RepackedMatrix's arrays (their code layout: quant_matmul.repacked_layout)
    when rows_per_group > 0, else its GGUF bytes ``data`` (code: _CODES)."""
    rows, (n_panels, cols, lanes), T = data.shape[0], x_panels.shape, out.shape[0]
    n_tiles = (rows + TILE_ROWS - 1) // TILE_ROWS
    for task in prange(n_tasks):
        tile = np.empty((TILE_ROWS, cols), dtype=np.float32)                        # (TILE_ROWS, cols)
        tile_out = np.empty((TILE_ROWS, n_panels * lanes), dtype=np.float32)         # (TILE_ROWS, T padded)
        for t in range(task * n_tiles // n_tasks, (task + 1) * n_tiles // n_tasks):
            first = t * TILE_ROWS
            n = min(TILE_ROWS, rows - first)
            if rows_per_group == 0:
                for i in range(n):
                    _decode_row(code, data[first + i], tile[i])
            else:  # whole groups (a group's rows past W are zero blocks); the code layout a constant
                groups = tile[:-(-n // rows_per_group) * rows_per_group]
                # layouts 0, 1, 2, 3: quant_fp32.Q8_0_CODE, quant_fp32.Q4_CODE, quant_matmul.Q4_CHUNKED,
                # quant_matmul.Q8_0_CHUNKED
                if layout == 0:
                    decode_repacked_rows(quants, scales, mins, 0, rows_per_group, first // rows_per_group, groups)
                elif layout == 1:
                    decode_repacked_rows(quants, scales, mins, 1, rows_per_group, first // rows_per_group, groups)
                elif layout == 2:
                    decode_repacked_rows(quants, scales, mins, 2, rows_per_group, first // rows_per_group, groups)
                else:
                    decode_repacked_rows(quants, scales, mins, 3, rows_per_group, first // rows_per_group, groups)
            for p in range(n_panels):
                for k0 in range(0, cols, K_CHUNK):
                    k1 = min(k0 + K_CHUNK, cols)
                    if lanes == NT:  # (WR and NT must be constants in each call)
                        for j0 in range(0, n, WR):  # a last block past row n computes rows nobody copies
                            weight_rows_tile(x_panels[p], tile, tile_out, p * NT, j0, k0, k1, WR, NT)
                    else:
                        for j0 in range(0, n, WR_NARROW):
                            weight_rows_tile(x_panels[p], tile, tile_out, 0, j0, k0, k1, WR_NARROW, NT_NARROW)
            # back to (T, rows), a tile's row of results at a time: stored column by column from the
            # registers instead, 1536 or 3072 rows apart, the same kernel ran 2x slower (measured)
            for i in range(T):
                for j in range(n):
                    out[i, first + j] = tile_out[j, i]


NO_BYTES, NO_FLOATS = np.empty(0, dtype=np.uint8), np.empty(0, dtype=np.float32)  # a plain QMatrix's


PANEL_K_BLOCK = 64  # k per job of _x_panels: a job reads `lanes` rows x 64 floats and writes 64 x `lanes`


@njit(cache=True, parallel=True)
def _x_panels(x, lanes):
    """x (T, cols) -> (panels, cols, lanes): x_panels[p, k, l] = x[p * lanes + l, k], zero past row T.

    Blocks of 64 k, each a job: the same transpose through NumPy (pad, reshape, transpose, copy) ran
    on one thread and 3.5-4.5x slower (T = 64..512, cols 576 and 1536: 53 us of a 473 us down
    projection at T = 64, measured on a 2-core Xeon VM)."""
    T, cols = x.shape
    n_panels, n_blocks = (T + lanes - 1) // lanes, (cols + PANEL_K_BLOCK - 1) // PANEL_K_BLOCK
    panels = np.empty((n_panels, cols, lanes), dtype=np.float32)  # (panels, cols, lanes)
    for job in prange(n_panels * n_blocks):
        p, block = job // n_blocks, job % n_blocks
        for k in range(block * PANEL_K_BLOCK, min((block + 1) * PANEL_K_BLOCK, cols)):
            for lane in range(lanes):
                row = p * lanes + lane
                panels[p, k, lane] = x[row, k] if row < T else np.float32(0.0)
    return panels


def qmatmul(x: np.ndarray, qm: QMatrix) -> np.ndarray:
    """x (T, cols) -> (T, rows) = x @ W.T; each packed weight is read and decoded once for all T rows."""
    x = _check_input(x, qm, 2)  # (T, cols)
    if isinstance(qm, RepackedMatrix) and TILE_ROWS % qm.rows_per_group:  # a tile must hold whole groups
        raise ValueError(f"the batched matmul decodes tiles of {TILE_ROWS} rows: a repacked matrix's rows_per_group "
                         f"must divide {TILE_ROWS}, got {qm.rows_per_group}")
    (T, cols), rows = x.shape, qm.shape[0]
    x_panels = _x_panels(x, NT_NARROW if T <= NT_NARROW else NT)  # (panels, cols, lanes)
    out = np.empty((T, rows), dtype=np.float32)
    if isinstance(qm, RepackedMatrix):
        _qmatmul(_CODES[qm.qtype], qm.data, qm.quants, qm.scales, qm.mins, qm.rows_per_group, repacked_layout(qm),
                 x_panels, out, numba.get_num_threads())
    else:
        _qmatmul(_CODES[qm.qtype], qm.data, NO_BYTES, NO_FLOATS, NO_FLOATS, 0, 0, x_panels, out, numba.get_num_threads())
    return out


# -----------------------------------------------------------------------------------------------
# The dispatch the model calls

# Where each path wins (benchmarks/quant_matvec.py, "batched": one matrix in cache, two threads,
# microseconds; benchmarks/results/quant_matvec.json, a 2-core Zen 5 VM, AVX-512):
#
#   Q4_1 1536 x 576 (ffn gate/up)   T = 1     2     3     4     8    16    64   256
#   qmatvec (GGUF blocks), row by row  71   144   208   185   433   996  4485 13687
#   qmatmul, GGUF blocks              252   271   264   189   194   267   520  1586
#   qmatmul, repacked                 127   144   125   102   127   139   378  1497
#   BLAS on fp32 weights               28   311   294   267   251   345   574  2451
#
# The matvec streams the packed bytes at memory speed, so running it once per row wins while T is
# tiny although it reads the weights T times; qmatmul decodes each weight once and multiplies it
# by every row in register blocks, 300 GFLOP/s at T = 64 and 256 here (65% of the 464 GFLOP/s the
# same process's FMA loop reached; two threads on this VM vary by +-30% from run to run). On one
# thread (quant_matvec_1thread.json) it reached 71-73% of that thread's peak at T = 64 and 58-67%
# at T = 256, where the activations' panels no longer fit in L2 beside the tile. On repacked
# weights the T-row matvec below takes over up to T = 8: it unpacks in registers and never writes
# a tile.
#
# Exact mode runs all T rows in one kernel (quant_fp32.matvec_rows): each weight is loaded and
# unpacked once and feeds T FMA chains. Same matrix, 2-core Zen 5 (LLVM znver5) shared with other
# jobs (load ~5), two threads, best of 300; AVX2 = NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES="":
#
#   T =                              1     2     3     4     5     8
#   AVX-512  fp32 matvec per row    17    36    50    70    82   129
#            fp32 matvec, T rows    16    21    28    36    43    80
#   AVX2     fp32 matvec per row    25    49    73    95   121   194
#            fp32 matvec, T rows    24    41    44    62    83   139
#
# It stays compute-bound (per 32 weights and row of x: a multiply and two FMAs), so T rows cost
# about 0.5-0.7x of T separate calls, not 1x of one.
MATVEC_ROWS_MAX_T = 3            # GGUF-layout QMatrix
REPACKED_MATVEC_ROWS_MAX_T = 8   # RepackedMatrix


def qlinear(x: np.ndarray, qm: QMatrix) -> np.ndarray:
    """x (T, cols) -> (T, rows) = x @ W.T, choosing the kernel by T:

    - T <= MATVEC_ROWS_MAX_T (REPACKED_MATVEC_ROWS_MAX_T for a RepackedMatrix; decode of a few
      streams, a speculative verify): the matvec kernels. On a RepackedMatrix one call of
      `quant_fp32.matvec_rows` (exact) or `quant_int8.matvec_rows` (int8) reads and unpacks each
      weight once for all T rows; otherwise `qmatvec` runs once per row, reading the packed bytes
      T times, at memory speed. Either way a row's result does not depend on the other rows (bit
      for bit).
    - larger T (decode batches, prefill): in int8 mode `quant_int8.matmul_rows`, the same T-row
      kernel over 8 rows of x at a time while a weight group stays in L1 - integer dot products
      at every T, and each row still bit for bit its one-row result; in exact mode `qmatmul`, each
      weight decoded once for all T rows and multiplied with register tiles in fp32 (it reads the
      GGUF bytes a RepackedMatrix keeps). Not BLAS: its thread pool and Numba's would fight over
      the cores inside a forward (cpu/__init__.py).
    The tables above MATVEC_ROWS_MAX_T have the measurements behind the thresholds.
    """
    x = _check_input(x, qm, 2)  # (T, cols)
    if x.shape[0] == 0:
        return np.empty((0, qm.shape[0]), dtype=np.float32)
    if x.shape[0] <= (REPACKED_MATVEC_ROWS_MAX_T if isinstance(qm, RepackedMatrix) else MATVEC_ROWS_MAX_T):
        if isinstance(qm, RepackedMatrix):  # (T, rows) each weight unpacked once for all T rows
            return (quant_int8 if qm.activations == "int8" else quant_fp32).matvec_rows(x, qm)
        if x.shape[0] == 1:
            return _matvec_checked(x[0], qm)[None, :]  # (1, rows) decode of one stream
        return np.stack([_matvec_checked(row, qm) for row in x])  # (T, rows)
    if isinstance(qm, RepackedMatrix) and qm.activations == "int8":
        return quant_int8.matmul_rows(x, qm)  # (T, rows) the T-row kernel, 8 rows of x at a time
    return qmatmul(x, qm)  # (T, rows)


# -----------------------------------------------------------------------------------------------
# What the CPU runs: the hot loop of the repacked kernels, for chapter 04

def inner_loop_asm(activations: str = "fp32", qtype: str = "Q4_1") -> list[str]:
    """The instructions of the innermost loop of the repacked matvec for ``activations`` ("fp32"
    or "int8") and ``qtype``, as compiled for this process's target (NUMBA_CPU_NAME honoured)."""
    w = repack(quantize(np.zeros((8, 64), dtype=np.float32), qtype), activations)
    constants = (quant_fp32.QTYPE_CODES[qtype], w.rows_per_group, 1)  # code layout, R, T
    if activations == "int8":
        kernel, constants = quant_int8.matvec_rows_into, (*constants, quant_int8.TARGET_ISA)
    else:
        kernel = quant_fp32.matvec_rows_into
    fresh = numba.njit(parallel=True)(kernel.py_func)  # Numba keeps no assembly for code it loaded from its cache
    x, out = np.zeros((1, 64), dtype=np.float32), np.empty((1, 8), dtype=np.float32)  # (1, cols), (1, rows)
    fresh(w.quants, w.scales, w.mins, x, out, *constants)  # once: `literally` makes the constants compile-time
    marker = "vfmadd|fmla" if activations == "fp32" else "vpdpbusd|vpmaddubsw|vpmaddwd|vpmulld|mul"
    return hot_loop_asm(next(iter(fresh.inspect_asm().values())), marker)
