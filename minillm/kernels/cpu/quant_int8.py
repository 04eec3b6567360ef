"""Integer mode (opt-in): activations quantized to int8 blocks, dot products in integers.

As llama.cpp does on CPUs: each activation row is quantized once per linear, per block of 32, to
int8 codes with a scale (ggml's Q8_1: d_x = max|x| / 127, q_x = round(x / d_x), and the block sum
s_x = d_x * sum q_x). A weight block then costs one integer dot product:

    y_r += d_r d_x * (sum_j q_rj q_xj) + m_r s_x        (Q4_0 folds its -8 into m_r = -8 d_r)

sum_j q_rj q_xj is exact in int32. On x86 it takes integer multiply-adds of bytes: ``vpmaddubsw``
multiplies unsigned weight codes by signed activation codes and adds neighbours into int16 (at most
2 * 15 * 127: no saturation), ``vpmaddwd`` against ones adds those into int32 lanes, 4 products
each; VNNI fuses both into ``vpdpbusd``. Which 4 products meet in a lane is the layout's choice:
codes come in 4-byte chunks of 16 rows (8 on AVX2; cpu/quant_repack.py), so one instruction takes
4 weights of each row against the same 4 activation codes, broadcast to every lane, and after a
block's 8 chunks lane r holds row r's whole integer sum - one conversion and two FMAs per block and
16 rows, no shuffles, no horizontal sums. Q8_0's signed codes (the LM head) are stored as q + 128,
so that ``vpdpbusd`` takes them as they are and the minimum is -128 d (as Q4_0's -8 d). Through
``vpmaddubsw`` a pair of 255 x 127 would saturate int16, so AVX2 (and AVX-512 without VNNI) code
multiplies |q| by x with q's sign instead (the "sign trick": pairs of at most 2 * 128 * 127).
Targets without these instructions (Arm, SSE) get the same arithmetic as generic vector IR -
widen, multiply, add.

The LM head's Q8_0 rows lay in exact mode's row order before (a block of a row filled 8 lanes, two
rows to a 512-bit vector, the sign trick on every ISA, a horizontal sum a row). Measured (2-core
Xeon VM, 2 threads, the SmolLM2 LM head 49152 x 576, medians of 40 calls, old and new alternated
in separate processes): T = 1 / 2 / 4 / 8 rows 568 / 807 / 1384 / 2335 -> 541 / 545 / 548 / 600 us
with AVX-512 VNNI code (the weights' 30 MB from memory bound it now up to T = 8); with AVX2 code
(NUMBA_CPU_NAME=haswell) 612 / 1023 / 1863 / 3435 -> 544 / 579 / 998 / 2012 us.
The only rounding is the activations' (and fp32 sums, as in exact mode): the quality cost is
measured against exact mode, not assumed (model/quality.py; chapter 04 prints it).

With T rows of x (a few decoding streams, a speculative verify of k + 1 tokens) each weight block
is loaded and unpacked once and feeds T integer dot products, as quant_fp32.matvec_rows does in
exact mode. The per-row arithmetic does not depend on T (same operations, same order), so row t
of a T-row call is bit for bit what a one-row call gives for x[t]: one kernel serves both.

Measured (2-core Xeon VM; Q4_1 1536 x 576; the row-pair layout this replaced, then the chunked one,
alternated in separate processes, 3 each, best of 300 calls; AVX2 = NUMBA_CPU_NAME=haswell
NUMBA_CPU_FEATURES=""): one thread, in cache, AVX-512 VNNI 23 -> 12 us, AVX2 30 -> 17 us (exact
mode: 60-70 and 81-90 us); two threads cycling 180 copies through L3 and DRAM, 32-36 -> 22-34 us.
The whole engine, int8 greedy decode (128 tokens, medians of 3 alternated runs, a noisy day):
144 -> 170 tok/s with AVX-512 code, 132 -> 163 tok/s with AVX2 code.

Without VNNI a block's 8 ``vpmaddubsw`` results are added as int16 (each lane at most 2 * 15 * 127,
8 of them 30480 < 2^15: exact) and widened once, not 8 times: the same integer sums. AVX2 code,
2 threads, the gate/up pair (3072 x 576) in cache, best of 50 (2-core Xeon VM): T = 1 19 -> 17 us,
T = 8 140 -> 91 us.

Many rows (a prefill, a decode batch past 8 streams, a verify of several sequences) run the same
kernel 8 rows at a time (``matmul_rows``): a thread holds one weight group in L1 and streams the
quantized rows of x past it. Integer dot products at every T, and every row still bit for bit its
one-row result, so int8 mode's linears give a row the same numbers however rows were batched
(attention still sums in another order in a prefill than in a decode step). Measured against
exact mode's fp32 ``qmatmul``, which int8 mode ran too before (2 threads, the SmolLM2 file, a
512-token prefill on a paged cache, each mode in its own process): the linears 493 -> 211 ms, the
prefill 628 -> 340 ms with AVX-512 VNNI code; 929 -> 598 ms with AVX2 code (before the int16 sums
above).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import literal_unroll, literally, njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from minillm.hardware.machine import compile_target
from minillm.kernels.cpu import quant_llvm as L
from minillm.kernels.cpu.quant_fp32 import Q8_0_CODE, QTYPE_CODES, prefetch_ahead
from minillm.kernels.cpu.quant_repack import RepackedMatrix
from minillm.kernels.cpu.variants import compile_variant

# Which integer multiply-add the kernel emits; tests run every one this host can execute.
GENERIC, AVX2, AVX512, AVX512_VNNI = 0, 1, 2, 3
ISA_NAMES = {GENERIC: "generic", AVX2: "avx2", AVX512: "avx512", AVX512_VNNI: "avx512-vnni"}


def target_isa() -> int:
    target = compile_target()
    if target.isa == "avx512":
        return AVX512_VNNI if target.vnni else AVX512
    return AVX2 if target.isa == "avx2" else GENERIC


# -----------------------------------------------------------------------------------------------
# Quantizing the activations (the NumPy model in the tests does the same float32 operations)

@intrinsic
def _quantize_block(typingctx, x, t, b, codes, scales, sums):
    """Block b of row t: x (T, cols) float32 -> codes[t, 32 b:32 b + 32] int8, scales[t, b] and
    sums[t, b] float32 (all 2-D C-contiguous), as vectors of 32 lanes: the scalar loop it replaced
    ran ~1.6 ns an activation (2.5 us for a 1536-wide row, 4 a layer, on the main thread while the
    other threads wait: ~0.15 ms of a ~4 ms int8 step on the 2-core Xeon VM). The same float32
    operations per lane as the scalar loop, so the same bits; the block's max and its integer sum
    do not depend on the order they are taken in."""
    def codegen(context, builder, sig, args):
        x_ptr, codes_ptr = L.array_data(context, builder, sig.args[0], args[0]), L.array_data(context, builder, sig.args[3], args[3])
        scales_ptr, sums_ptr = (L.array_data(context, builder, sig.args[i], args[i]) for i in (4, 5))
        t, b = args[1], args[2]
        cols, n_blocks = L.array_shape(context, builder, sig.args[0], args[0], 1), L.array_shape(context, builder, sig.args[4], args[4], 1)
        vf, vi = L.vector(L.F32, 32), L.vector(L.I32, 32)
        at = builder.add(builder.mul(t, cols), builder.mul(b, L.index(32)))
        block = L.load(builder, x_ptr, at, vf)                                         # (32,) x
        largest = L.call(builder, "llvm.vector.reduce.fmax.v32f32", L.F32,
                         L.call(builder, "llvm.fabs.v32f32", vf, block))                # max |x|
        d = builder.fdiv(largest, L.F32(127.0))
        inverse = builder.select(builder.fcmp_ordered("!=", d, L.F32(0.0)), builder.fdiv(L.F32(1.0), d), L.F32(0.0))
        v = builder.fmul(block, L.splat(builder, inverse, 32))                          # (32,) x / d
        rounded = L.call(builder, "llvm.floor.v32f32", vf,
                         builder.fadd(L.call(builder, "llvm.fabs.v32f32", vf, v), L.constant_vector(L.F32, [0.5] * 32)))
        magnitude = builder.fptosi(rounded, vi)                                         # roundf: halves away from 0
        negative = builder.fcmp_ordered("<", v, L.constant_vector(L.F32, [0.0] * 32))
        q = builder.select(negative, builder.neg(magnitude), magnitude)                 # (32,) int32 codes
        L.store(builder, codes_ptr, at, builder.trunc(q, L.vector(L.I8, 32)))
        total = L.call(builder, "llvm.vector.reduce.add.v32i32", L.I32, q)
        at_block = builder.add(builder.mul(t, n_blocks), b)
        builder.store(d, builder.gep(scales_ptr, [at_block]))
        builder.store(builder.fmul(d, builder.sitofp(total, L.F32)), builder.gep(sums_ptr, [at_block]))
        return context.get_dummy_value()

    return types.void(x, t, b, codes, scales, sums), codegen


def _quantize_rows(x):
    """x (T, cols) float32 -> codes int8 (T, cols), scales float32 (T, blocks), sums float32 (T, blocks).

    Rounding as C's roundf (halves away from zero), as ggml's quantize_row_q8_1. The scale stays
    fp32 (ggml rounds it to fp16): nothing here is stored, so there is no reason to lose bits.
    x must be C-contiguous (quant.qlinear and the fused layer pass it so).
    """
    T, n_blocks = x.shape[0], x.shape[1] // 32
    codes = np.empty(x.shape, dtype=np.int8)              # (T, cols)
    scales = np.empty((T, n_blocks), dtype=np.float32)    # (T, blocks)
    sums = np.empty((T, n_blocks), dtype=np.float32)      # (T, blocks)
    for t in prange(T):  # a plain loop where parallel is off
        for b in range(n_blocks):
            _quantize_block(x, t, b, codes, scales, sums)
    return codes, scales, sums


# The one-row and T-row kernels quantize their few rows on the calling thread (a fork and a join
# would cost more than the rows); matmul_rows shares a prefill's rows among the threads (512 rows
# of 1536 on one thread: ~0.5 ms a linear). The same blocks either way, so the same bits.
quantize_activations = njit(cache=True)(_quantize_rows)
quantize_activations_parallel = njit(parallel=True)(_quantize_rows)  # not cached: one index per function


# -----------------------------------------------------------------------------------------------
# One row group's integer dot products

def _dot_accumulate(builder, isa, acc, u, s):
    """acc (<n x i32>) + the sums of 4 neighbouring products of u (<4n x i8>, unsigned) and s
    (<4n x i8>, signed): lane k gains u[4k] s[4k] + ... + u[4k + 3] s[4k + 3]."""
    n = acc.type.count
    if isa == AVX512_VNNI:
        return L.call(builder, "llvm.x86.avx512.vpdpbusd.512", acc.type, acc,
                      builder.bitcast(u, acc.type), builder.bitcast(s, acc.type))
    if isa == GENERIC:
        products = builder.mul(builder.zext(u, L.vector(L.I32, 4 * n)), builder.sext(s, L.vector(L.I32, 4 * n)))
        fours = [L.pick(builder, products, products, range(i, 4 * n, 4)) for i in range(4)]
        return builder.add(acc, builder.add(builder.add(fours[0], fours[1]), builder.add(fours[2], fours[3])))
    return builder.add(acc, _widen_pairs(builder, isa, _pair_products(builder, isa, u, s)))


def _pair_products(builder, isa, u, s):
    """``vpmaddubsw`` (AVX2, AVX-512 without VNNI): <2n x i16>, lane k = u[2k] s[2k] + u[2k + 1] s[2k + 1],
    saturated to int16 (which 4-bit codes never reach, 2 * 15 * 127 = 3810, nor the sign trick's
    |q| <= 128, 2 * 128 * 127 = 32512)."""
    n2 = u.type.count // 2
    name = "llvm.x86.avx512.pmaddubs.w.512" if isa == AVX512 else "llvm.x86.avx2.pmadd.ub.sw"
    return L.call(builder, name, L.vector(L.I16, n2), u, s)


def _widen_pairs(builder, isa, pairs):
    """``vpmaddwd`` against ones: <2n x i16> -> <n x i32>, lane k = pairs[2k] + pairs[2k + 1]."""
    n2 = pairs.type.count
    name = "llvm.x86.avx512.pmaddw.d.512" if isa == AVX512 else "llvm.x86.avx2.pmadd.wd"
    return L.call(builder, name, L.vector(L.I32, n2 // 2), pairs, L.constant_vector(L.I16, [1] * n2))


def chunk_lanes(isa: int) -> int:
    """Rows of the chunked layout (cpu/quant_repack.py) one vector of int32 lanes takes: 16 on
    AVX-512, 8 elsewhere (AVX2; generic vectors as wide, which LLVM splits where it must)."""
    return 16 if isa in (AVX512, AVX512_VNNI) else 8


def _chunked_codegen(R: int, T: int, isa: int, code_bytes: int):
    """Codes in the chunked layout (cpu/quant_repack.py), 16 bytes a row and block for 4-bit codes,
    32 for Q8_0's. Per block and vector of rows, 8 chunks of 4 codes of every row meet the matching
    4 activation codes broadcast to every lane; lane r sums row r's block in int32, then one
    conversion and two FMAs (d_r d_x, then the minimum's m_r s_x) add it to the row's sum; d and m
    widened from fp16 where the repacked matrix keeps them so.

    4-bit codes: 4 loads a block, each masked and shifted into two chunks (weights 4k.., 16 + 4k..).
    Q8_0: 8 loads of codes stored as q + 128 (unsigned, as ``vpdpbusd`` takes them), so the sum is
    sum (q + 128) x = sum q x + 128 sum x and the minimum is m_r = -128 d_r (as Q4_0's -8 d_r). Where
    the products go through ``vpmaddubsw`` (AVX2, AVX-512 without VNNI) a pair of 255 x 127 would
    saturate int16: those take sum q x itself, by the sign trick - |q| times x with q's sign, pairs of
    at most 2 x 128 x 127 - widened to int32 every chunk, and no minimum.

    With VNNI a block's 8 chunks are one chain of dependent ``vpdpbusd`` per row of x. Split into 2,
    4 or 8 chains (integer sums: the same results), the layer matrices ran no faster (2-core Xeon
    VM, 2 threads, T = 1..8, one matrix in cache and all 30 layers' in turn): not kept."""
    lanes = chunk_lanes(isa)
    pairs_in_int16 = isa in (AVX2, AVX512)
    q8 = code_bytes == 32
    sign_trick = q8 and pairs_in_int16  # else Q8_0's sum is of q + 128, with the minimum -128 d
    # a block's sums: int32 lanes, or int16 pairs where vpmaddubsw makes them from 4-bit codes (8
    # products of pairs, each at most 2 * 15 * 127, add up to 30480 < 2^15: one widening a block, not
    # 8); the sign trick's pairs (up to 32512) are widened chunk by chunk
    int16_block = pairs_in_int16 and not q8

    def chunks(builder, q_ptr, first, v):
        """The block's 8 chunks (<4 lanes x i8>) of vector v's rows, with the activation offset of each."""
        block = builder.mul(first, L.index(code_bytes))
        chunk = L.vector(L.I8, 4 * lanes)
        if q8:  # [g, b, k, r, i]: byte 4k + i of row r, k = 0..7
            return [(L.load(builder, q_ptr, builder.add(block, L.index(4 * (k * R + v * lanes))), chunk), 4 * k)
                    for k in range(8)]
        out = []
        for k in range(4):  # [g, b, k, r, i]: code byte 4k + i, weights 4k + i (low) and 16 + 4k + i (high)
            nibbles = L.load(builder, q_ptr, builder.add(block, L.index(4 * (k * R + v * lanes))), chunk)
            out += [(builder.and_(nibbles, L.constant_vector(L.I8, [15] * (4 * lanes))), 4 * k),
                    (builder.lshr(nibbles, L.constant_vector(L.I8, [4] * (4 * lanes))), 16 + 4 * k)]
        return out

    def codegen(context, builder, sig, args):
        q_ptr, d_ptr, m_ptr, xq_ptr, xd_ptr, xs_ptr = (L.array_data(context, builder, sig.args[i], args[i])
                                                       for i in range(6))
        out_ptr = L.array_data(context, builder, sig.args[7], args[7])
        g = args[6]
        half = sig.args[1].dtype == types.uint16
        n_blocks = L.array_shape(context, builder, sig.args[4], args[4], 1)
        cols = builder.mul(n_blocks, L.index(32))
        padded_rows = L.array_shape(context, builder, sig.args[7], args[7], 1)
        vf = L.vector(L.F32, lanes)
        acc = {(v, t): L.accumulator(builder, L.constant_vector(L.F32, [0.0] * lanes))
               for v in range(R // lanes) for t in range(T)}  # (lanes,) per vector of rows and row of x
        with cgutils.for_range(builder, n_blocks) as loop:
            b = loop.index
            first = builder.mul(builder.add(builder.mul(g, n_blocks), b), L.index(R))  # (group, block, row 0)
            prefetch_ahead(builder, q_ptr, builder.mul(first, L.index(code_bytes)), R * code_bytes)
            x_block = [builder.add(builder.mul(L.index(t), cols), builder.mul(b, L.index(32))) for t in range(T)]
            at_t = [builder.add(builder.mul(L.index(t), n_blocks), b) for t in range(T)]
            d_x = [L.splat(builder, builder.load(builder.gep(xd_ptr, [at])), lanes) for at in at_t]
            s_x = [] if sign_trick else [L.splat(builder, builder.load(builder.gep(xs_ptr, [at])), lanes)
                                         for at in at_t]  # no minimum with the sign trick
            for v in range(R // lanes):
                sums = ([L.constant_vector(L.I16, [0] * (2 * lanes)) for _ in range(T)] if int16_block
                        else [L.constant_vector(L.I32, [0] * lanes) for _ in range(T)])
                for codes, offset in chunks(builder, q_ptr, first, v):
                    if sign_trick:  # |q| and q's sign, once for all T rows of x
                        signed = builder.xor(codes, L.constant_vector(L.I8, [-128] * (4 * lanes)))  # q
                        negative = builder.icmp_signed("<", signed, L.constant_vector(L.I8, [0] * (4 * lanes)))
                        codes = builder.select(negative, builder.neg(signed), signed)  # |q| (128 stays 128 as u8)
                    for t in range(T):
                        four = L.load(builder, xq_ptr, builder.add(x_block[t], L.index(offset)), L.I32)
                        x = builder.bitcast(L.splat(builder, four, lanes), codes.type)  # 4 codes, every lane
                        if sign_trick:
                            x = (L.call(builder, "llvm.x86.avx2.psign.b", x.type, x, signed) if isa == AVX2
                                 else builder.select(negative, builder.neg(x), x))  # x with q's sign
                        if int16_block:
                            sums[t] = builder.add(sums[t], _pair_products(builder, isa, codes, x))
                        else:
                            sums[t] = _dot_accumulate(builder, isa, sums[t], codes, x)
                if int16_block:
                    sums = [_widen_pairs(builder, isa, pairs) for pairs in sums]  # (lanes,) int32
                rows = builder.add(first, L.index(v * lanes))
                d = L.load_scales(builder, d_ptr, rows, lanes, half)  # (lanes,) d_r
                if q8:
                    m = None if sign_trick else builder.fmul(d, L.constant_vector(L.F32, [-128.0] * lanes))
                else:
                    m = L.load_scales(builder, m_ptr, rows, lanes, half)  # (lanes,) m_r
                for t in range(T):
                    total = L.fma(builder, builder.sitofp(sums[t], vf), builder.fmul(d, d_x[t]),
                                  builder.load(acc[v, t]))
                    builder.store(total if m is None else L.fma(builder, m, s_x[t], total), acc[v, t])
        for (v, t), total in acc.items():
            at = builder.add(builder.mul(L.index(t), padded_rows), builder.add(builder.mul(g, L.index(R)),
                                                                               L.index(v * lanes)))
            L.store(builder, out_ptr, at, builder.load(total))
        return context.get_dummy_value()

    return codegen


@intrinsic
def _group_dot(typingctx, quants, scales, mins, x_codes, x_scales, x_sums, group, out,
               qtype_code, rows_per_group, tokens, isa):
    """out[t, group * R + r] = row r of the group . the quantized activations of row t, for one
    group's R rows and the T rows of x (2-D C-contiguous: x_codes (T, cols), x_scales and x_sums
    (T, blocks), out (T, padded rows))."""
    literal = (qtype_code, rows_per_group, tokens, isa)
    if not all(isinstance(t, types.IntegerLiteral) for t in literal):
        return None
    code, R, T, isa_code = (t.literal_value for t in literal)
    codegen = _chunked_codegen(R, T, isa_code, 32 if code == Q8_0_CODE else 16)
    signature = types.void(quants, scales, mins, x_codes, x_scales, x_sums, group, out,
                           qtype_code, rows_per_group, tokens, isa)
    return signature, codegen


# Not cached on disk: its variants (one per set of constants) would share one index (cpu/variants.py).
# Its callers are, each variant under its own name, with this compiled into them (~1 s when new).
@njit(parallel=True)
def matvec_rows_into(quants, scales, mins, x, out, qtype_code, rows_per_group, tokens, isa):
    """out (T, padded rows) ~ x (T, cols) W^T for the repacked W, int8 activations: the kernel
    itself, for compiled callers (``_kernel`` below, cpu/fused_decode.py). The last four arguments
    must be compile-time constants, as in quant_fp32.matvec_rows_into. Nothing is checked."""
    literally(qtype_code)
    literally(rows_per_group)
    literally(tokens)
    literally(isa)
    x_codes, x_scales, x_sums = quantize_activations(x)  # (T, cols), (T, blocks), (T, blocks)
    for g in prange(out.shape[1] // rows_per_group):
        _group_dot(quants, scales, mins, x_codes, x_scales, x_sums, g, out,
                   qtype_code, rows_per_group, tokens, isa)


@functools.cache
def _kernel(qtype_code: int, rows_per_group: int, tokens: int, isa: int):
    """The kernel for one code layout, R, T and instruction set, as a function of the arrays alone,
    compiled on first use and cached on disk (cpu/variants.py)."""
    def matvec_kernel(quants, scales, mins, x, out):
        matvec_rows_into(quants, scales, mins, x, out, qtype_code, rows_per_group, tokens, isa)

    return compile_variant(matvec_kernel, code=qtype_code, R=rows_per_group, T=tokens, isa=isa)


# -----------------------------------------------------------------------------------------------
# Many rows of x: a prefill, a decode batch of more than 8 streams, a verify of several sequences

X_TILE = 8  # rows of x per call of the T-row kernel below: the largest T qlinear sends to matvec_rows
ROW_PIECES = (X_TILE, 4, 2, 1)  # whole tiles, then the rest: each size at most once after the tiles


# Not cached on disk, as matvec_rows_into; ``_matmul_kernel`` is.
@njit(parallel=True)
def matmul_rows_into(quants, scales, mins, x, out, qtype_code, rows_per_group, isa):
    """out (T, padded rows) ~ x (T, cols) W^T for any T: a thread takes a weight group and runs the
    T-row kernel over x X_TILE rows at a time, so the group's codes are read from memory once and
    unpacked once a tile, from L1; the rows past the last whole tile go through at most one call each
    of 4, 2 and 1 rows, so that one kernel serves every T (a variant per T % 8 was a compile of
    seconds the first time a server met each batch size). Row t is bit for bit matvec(x[t]): the
    same kernel on the same row. Constants as in matvec_rows_into."""
    literally(qtype_code)
    literally(rows_per_group)
    literally(isa)
    x_codes, x_scales, x_sums = quantize_activations_parallel(x)  # (T, cols), (T, blocks), (T, blocks)
    for g in prange(out.shape[1] // rows_per_group):
        _group_rows(quants, scales, mins, x_codes, x_scales, x_sums, g, out, qtype_code, rows_per_group, isa)


@njit
def _group_rows(quants, scales, mins, x_codes, x_scales, x_sums, g, out, qtype_code, rows_per_group, isa):
    """Group g against every row of x: whole tiles of X_TILE rows, then the rest in pieces (a loop of
    its own: literal_unroll inside a prange body stops it running in parallel)."""
    literally(qtype_code)
    literally(rows_per_group)
    literally(isa)
    t = 0
    for size in literal_unroll(ROW_PIECES):  # a compile-time constant in each copy of the body
        while t + size <= x_codes.shape[0]:
            _group_dot(quants, scales, mins, x_codes[t:t + size], x_scales[t:t + size], x_sums[t:t + size], g,
                       out[t:t + size], qtype_code, rows_per_group, size, isa)
            t += size


@functools.cache
def _matmul_kernel(qtype_code: int, rows_per_group: int, isa: int):
    """matmul_rows_into for one code layout, R and instruction set, as a function of the arrays
    alone, compiled on first use and cached on disk (cpu/variants.py)."""
    def matmul_kernel(quants, scales, mins, x, out):
        matmul_rows_into(quants, scales, mins, x, out, qtype_code, rows_per_group, isa)

    return compile_variant(matmul_kernel, code=qtype_code, R=rows_per_group, isa=isa)


def rows_per_group_problem(w: RepackedMatrix, isa: int) -> str | None:
    """Why the ``isa`` kernel cannot take w's R, or None."""
    if w.rows_per_group % chunk_lanes(isa):
        return (f"the {ISA_NAMES[isa]} kernel takes rows {chunk_lanes(isa)} to a vector: "
                f"rows_per_group must be a multiple of {chunk_lanes(isa)}, got {w.rows_per_group}")
    return None


def kernel_for(w: RepackedMatrix, isa: int, tokens: int = 1):
    return _kernel(QTYPE_CODES[w.qtype], w.rows_per_group, tokens, isa)


def matvec(x: np.ndarray, w: RepackedMatrix, isa: int | None = None) -> np.ndarray:
    """x (cols,) float32 -> (rows,) ~ W x with int8 activations; ``isa``: this target's best unless given."""
    return matvec_rows(x[None, :], w, isa)[0]


def matvec_rows(x: np.ndarray, w: RepackedMatrix, isa: int | None = None) -> np.ndarray:
    """x (T, cols) float32 -> (T, rows) ~ x W^T with int8 activations, each packed weight read and
    unpacked once for all T rows (x must already be checked: quant.qlinear). Row t is bit for bit
    what ``matvec(x[t])`` gives. One kernel is compiled per T: callers keep T small (qlinear: <= 8)."""
    return _run(x, w, isa, lambda isa: kernel_for(w, isa, x.shape[0]))


def matmul_rows(x: np.ndarray, w: RepackedMatrix, isa: int | None = None) -> np.ndarray:
    """x (T, cols) float32 -> (T, rows) ~ x W^T with int8 activations, for any T (qlinear sends
    T > 8 here): row t bit for bit ``matvec(x[t])``, as in matvec_rows, each weight group read once
    and unpacked once every X_TILE rows. One kernel serves every T."""
    return _run(x, w, isa, lambda isa: _matmul_kernel(QTYPE_CODES[w.qtype], w.rows_per_group, isa))


def _run(x: np.ndarray, w: RepackedMatrix, isa: int | None, kernel_for_isa) -> np.ndarray:
    """The compiled kernel ``kernel_for_isa(isa)`` (this target's best ISA unless given) on x and w,
    once w's R is one it takes -> (T, rows), cut from the kernel's padded (T, groups * R) output."""
    if isa is None:
        isa = TARGET_ISA
    problem = rows_per_group_problem(w, isa)
    if problem:
        raise ValueError(problem)
    out = np.empty((x.shape[0], w.groups * w.rows_per_group), dtype=np.float32)  # (T, padded rows)
    kernel_for_isa(isa)(w.quants, w.scales, w.mins, x, out)
    return out[:, :w.shape[0]]


TARGET_ISA = target_isa()
