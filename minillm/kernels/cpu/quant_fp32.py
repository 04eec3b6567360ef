"""Exact mode: the decode matvec on repacked weights (cpu/quant_repack.py), activations in fp32.

For a row group (R rows) and one block b, with x the block's 32 activations:

    y_r += d_r * (sum_j q_rj x_j) + m_r * (sum_j x_j)

The minimum leaves the inner loop: sum x is computed once per block for every row of the matrix
(``block_sums``), so the loop only converts codes and multiplies. Per row and block it loads 16
bytes, makes the low and high nibbles two vectors of 16 fp32 lanes (one mask, one shift, two
conversions), multiplies them by the two halves of x (which stay in registers for all R rows),
and adds d_r times that into the row's accumulator - one FMA chain per row, summed across lanes
only at the end. The IR is generic LLVM vectors, so the same code compiles for AVX-512, AVX2 and
NEON; ``quant.inner_loop_asm`` shows what it becomes.

Measured (shared 2-core Sapphire Rapids, one thread, best of 25 runs, one matrix in cache; AVX2 is
NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=""), microseconds and GB/s of packed bytes:

    Q4_1 1536 x 576 (553 KB)       AVX-512         AVX2
    GGUF-layout quant.qmatvec    190-200 (2.8)   184-200 (2.9)
    this kernel                   60-70 (8.5)      81-90 (6.5)
    Q8_0 LM head 49152 x 576 (30 MB, from L3): 2.6-3.0 ms (10-11 GB/s) on AVX-512.

With T rows of x (a speculative verify, a few decoding streams) each unpacked block feeds T FMA
chains instead of one: the weights are read once per call, not once per row (``matvec_rows``).

In cache the loop is compute-bound: per 32 weights it issues a byte-to-dword widening, a mask, a
shift, two conversions, a multiply and two FMAs (cpu/quant_int8.py halves that work). Streaming
the weights from L3 or DRAM, as decode does, it also has to ask for them ahead of time
(``PREFETCH_BYTES``): without that, the same kernel ran 1.8x (AVX-512) and 3.3x (AVX2 code) slower.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import literally, njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from minillm.hardware.machine import compile_target
from minillm.hardware.microbench import CACHE_LINE_BYTES
from minillm.kernels.cpu import quant_llvm as L
from minillm.kernels.cpu.quant_repack import RepackedMatrix
from minillm.kernels.cpu.variants import compile_variant

Q8_0_CODE, Q4_CODE = 0, 1  # how a block's codes unpack: int8, or two nibbles (Q4_0 and Q4_1 alike)
QTYPE_CODES = {"Q8_0": Q8_0_CODE, "Q4_0": Q4_CODE, "Q4_1": Q4_CODE}


def unpack_fp32(builder, quants, at, qtype_code):
    """The 32 codes of one row's block at byte ``at`` -> (weights 0..15, weights 16..31) as <16 x float>."""
    v16f = L.vector(L.F32, 16)
    if qtype_code == Q8_0_CODE:
        low = L.load(builder, quants, at, L.vector(L.I8, 16))
        high = L.load(builder, quants, builder.add(at, L.index(16)), L.vector(L.I8, 16))
        return builder.sitofp(low, v16f), builder.sitofp(high, v16f)
    return nibbles_fp32(builder, L.load(builder, quants, at, L.vector(L.I8, 16)))


def nibbles_fp32(builder, codes):
    """A row's block of 4-bit codes, <16 x i8> in GGUF's order -> (weights 0..15, 16..31) as <16 x float>."""
    v16f = L.vector(L.F32, 16)
    # widened to int32 first, then masked and shifted: one widening shuffle a block instead of two
    # (three on AVX2: a shuffle is what Intel cores run on one port only), 5-10% faster in cache
    # (2-core Xeon VM, AVX-512 and AVX2 code) and the same values
    nibbles = builder.zext(codes, L.vector(L.I32, 16))
    low = builder.and_(nibbles, L.constant_vector(L.I32, [15] * 16))
    high = builder.lshr(nibbles, L.constant_vector(L.I32, [4] * 16))
    return builder.sitofp(low, v16f), builder.sitofp(high, v16f)


# How far ahead of the block being unpacked the kernels ask for the packed weights. Decode streams
# ~100 MB of them per token and the loop's work per byte is large, so the hardware prefetchers and
# the out-of-order window alone keep too few loads in flight. Measured (2-core Xeon VM, two threads,
# 180 copies of a Q4_1 1536 x 576 matrix cycled so they come from L3 and DRAM, as in decode, exact
# kernel): no prefetch 50 us a matrix on AVX-512, 115 us with AVX2 code; 512 / 1024 / 2048 / 4096 /
# 8192 bytes ahead, 39 / 35 / 32 / 32 / 32 us on AVX-512, 35 / 33 us (2048 / 4096) with AVX2 code.
PREFETCH_BYTES = 4096


def prefetch_ahead(builder, quants, first_byte, block_bytes: int) -> None:
    """Prefetch the cache lines of a block's codes PREFETCH_BYTES past ``first_byte``."""
    for line in range(0, block_bytes, CACHE_LINE_BYTES):
        L.prefetch(builder, quants, builder.add(first_byte, L.index(PREFETCH_BYTES + line)))


def add_min_terms(builder, mins, block_sums, first, b, R, min_terms):
    """min_terms (R lanes) += m_r * block_sums[b] for the R rows from index ``first``: the minimum's
    share, once per block and row whatever the codes (the int8 kernel passes d_x sum q_x)."""
    block_sum = L.splat(builder, builder.load(builder.gep(block_sums, [b])), R)
    row_mins = L.load(builder, mins, first, L.vector(L.F32, R))  # (R,)
    builder.store(L.fma(builder, row_mins, block_sum, builder.load(min_terms)), min_terms)


def store_row(builder, out, g, R, r, lanes, start):
    """out[g * R + r] = start + the lanes' sum."""
    at = builder.add(builder.mul(g, L.index(R)), L.index(r))
    builder.store(L.horizontal_sum(builder, lanes, start), builder.gep(out, [at]))


def rows_per_pass(R: int, T: int) -> int:
    """Rows of a group handled per pass over the blocks when x has T rows: R x T running sums of
    16 floats must stay in registers (32 of 512 bits on AVX-512, 16 of 256 on AVX2, where a sum
    takes two), beside the 2T activation vectors. At T = 1 a pass is the whole group."""
    budget = 16 if compile_target().vector_bits == 512 else 4  # sums of 16 floats that fit with the rest
    rows = R
    while rows > 1 and rows * T > budget:
        rows //= 2
    return rows


@intrinsic
def _group_dot(typingctx, quants, scales, mins, x, block_sums, group, n_blocks, out, qtype_code, rows_per_group,
               tokens):
    """out[t, group * R + r] = row r of the group . x[t], for the R rows of one group and the T rows
    of x (2-D C-contiguous: x (T, cols), block_sums (T, blocks), out (T, padded rows))."""
    if not all(isinstance(c, types.IntegerLiteral) for c in (qtype_code, rows_per_group, tokens)):
        return None
    code, R, T = qtype_code.literal_value, rows_per_group.literal_value, tokens.literal_value
    code_bytes = 32 if code == Q8_0_CODE else 16

    def codegen(context, builder, sig, args):
        q_ptr, d_ptr, m_ptr, x_ptr, sums_ptr = (L.array_data(context, builder, sig.args[i], args[i]) for i in range(5))
        out_ptr = L.array_data(context, builder, sig.args[7], args[7])
        g, n_blocks = args[5], args[6]
        cols = builder.mul(n_blocks, L.index(32))
        padded_rows = L.array_shape(context, builder, sig.args[7], args[7], 1)
        v16f, vRf = L.vector(L.F32, 16), L.vector(L.F32, R)
        min_terms = [L.accumulator(builder, L.constant_vector(L.F32, [0.0] * R)) for _ in range(T)]
        per_pass = rows_per_pass(R, T)
        for first_row in range(0, R, per_pass):  # each pass: its rows' accumulators, all of the blocks
            pass_rows = range(first_row, first_row + per_pass)
            acc = {(r, t): L.accumulator(builder, L.constant_vector(L.F32, [0.0] * 16)) for r in pass_rows for t in range(T)}
            with cgutils.for_range(builder, n_blocks) as loop:
                b = loop.index
                at_x = [builder.add(builder.mul(L.index(t), cols), builder.mul(b, L.index(32))) for t in range(T)]
                x_low = [L.load(builder, x_ptr, at, v16f) for at in at_x]                          # T x (16,)
                x_high = [L.load(builder, x_ptr, builder.add(at, L.index(16)), v16f) for at in at_x]
                first = builder.mul(builder.add(builder.mul(g, n_blocks), b), L.index(R))  # (group, block, row 0)
                d = L.load(builder, d_ptr, first, vRf)                                             # (R,)
                if first_row == 0:  # once a block: later passes re-read the group's codes from the caches
                    prefetch_ahead(builder, q_ptr, builder.mul(first, L.index(code_bytes)), R * code_bytes)
                    if code != Q8_0_CODE:  # the minimum's share (Q8_0 has no minimum)
                        for t in range(T):
                            sums_t = builder.gep(sums_ptr, [builder.mul(L.index(t), n_blocks)])
                            add_min_terms(builder, m_ptr, sums_t, first, b, R, min_terms[t])
                for r in pass_rows:
                    at = builder.mul(builder.add(first, L.index(r)), L.index(code_bytes))
                    low, high = unpack_fp32(builder, q_ptr, at, code)  # unpacked once for all T rows of x
                    d_r = L.splat(builder, L.lane(builder, d, r), 16)
                    for t in range(T):
                        qx = L.fma(builder, high, x_high[t], builder.fmul(low, x_low[t]))             # (16,)
                        builder.store(L.fma(builder, d_r, qx, builder.load(acc[r, t])), acc[r, t])
            for t in range(T):
                out_t = builder.gep(out_ptr, [builder.mul(L.index(t), padded_rows)])
                terms = builder.load(min_terms[t])
                for r in pass_rows:
                    store_row(builder, out_t, g, R, r, builder.load(acc[r, t]), L.lane(builder, terms, r))
        return context.get_dummy_value()

    return (types.void(quants, scales, mins, x, block_sums, group, n_blocks, out, qtype_code, rows_per_group, tokens),
            codegen)


@njit(cache=True, inline="always")
def block_sums_of(x):
    """x (T, cols) -> (T, cols // 32): the sum of each block of 32 activations (the minimum's factor)."""
    sums = np.empty((x.shape[0], x.shape[1] // 32), dtype=np.float32)  # (T, blocks)
    for t in range(x.shape[0]):
        for b in range(sums.shape[1]):
            total = np.float32(0.0)
            for j in range(b * 32, b * 32 + 32):
                total += x[t, j]
            sums[t, b] = total
    return sums


# Not cached on disk: its variants (one per set of constants) would share one index (cpu/variants.py).
# Its callers are, each variant under its own name, with this compiled into them (~1 s when new).
@njit(parallel=True)
def matvec_rows_into(quants, scales, mins, x, out, qtype_code, rows_per_group, tokens):
    """out (T, padded rows) = x (T, cols) W^T for the repacked W (quants, scales, mins), exact mode.

    The kernel itself, for compiled callers (``_kernel`` below, cpu/fused_decode.py). qtype_code,
    rows_per_group and tokens must be compile-time constants (the intrinsic unrolls over R and T):
    a compiled caller passes constants; from Python, ``literally`` would retype every call (ms).
    Nothing is checked: x must be C-contiguous (T, cols) float32, out (T, groups * R).
    """
    literally(qtype_code)
    literally(rows_per_group)
    literally(tokens)
    block_sums = block_sums_of(x)  # (T, blocks)
    for g in prange(out.shape[1] // rows_per_group):
        _group_dot(quants, scales, mins, x, block_sums, g, x.shape[1] // 32, out, qtype_code, rows_per_group,
                   tokens)


@functools.cache
def _kernel(qtype_code: int, rows_per_group: int, tokens: int):
    """The kernel for one code layout, R and T, as a function of the arrays alone (Python calls it
    at C speed), compiled on first use and cached on disk (cpu/variants.py)."""
    def matvec_kernel(quants, scales, mins, x, out):
        matvec_rows_into(quants, scales, mins, x, out, qtype_code, rows_per_group, tokens)

    return compile_variant(matvec_kernel, code=qtype_code, R=rows_per_group, T=tokens)


def kernel_for(w: RepackedMatrix, tokens: int = 1):
    return _kernel(QTYPE_CODES[w.qtype], w.rows_per_group, tokens)


def matvec(x: np.ndarray, w: RepackedMatrix) -> np.ndarray:
    """x (cols,) float32 -> (rows,) = W x, exact mode (x must already be checked: quant.qmatvec)."""
    return matvec_rows(x[None, :], w)[0]


def matvec_rows(x: np.ndarray, w: RepackedMatrix) -> np.ndarray:
    """x (T, cols) float32 -> (T, rows) = x W^T, exact mode, each packed weight read and unpacked once
    for all T rows (x must already be checked: quant.qlinear). Row t's result is bit-for-bit the
    one matvec gives for x[t]: the same operations in the same order."""
    out = np.empty((x.shape[0], w.groups * w.rows_per_group), dtype=np.float32)  # (T, padded rows)
    kernel_for(w, x.shape[0])(w.quants, w.scales, w.mins, x, out)
    return out[:, :w.shape[0]]
