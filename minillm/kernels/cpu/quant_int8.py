"""Integer mode (opt-in): activations quantized to int8 blocks, dot products in integers.

As llama.cpp does on CPUs: the activation row is quantized once per linear, per block of 32, to
int8 codes with a scale (ggml's Q8_1: d_x = max|x| / 127, q_x = round(x / d_x), and the block sum
s_x = d_x * sum q_x). A weight block then costs one integer dot product:

    y_r += d_r d_x * (sum_j q_rj q_xj) + m_r s_x        (Q4_0 folds its -8 into m_r = -8 d_r)

sum_j q_rj q_xj is exact in int32. On x86 it is two instructions: ``vpmaddubsw`` multiplies 32
unsigned weight codes by 32 signed activation codes and adds neighbours into 16 int16 (at most
2 * 15 * 127, or 2 * 128 * 127 for Q8_0: no saturation), ``vpmaddwd`` against ones adds those into
8 int32. AVX-512 does two rows per instruction; VNNI fuses both into ``vpdpbusd``. Q8_0 weights are
signed: the kernel multiplies |w| by x with w's sign (the "sign trick"). Targets without these
instructions (Arm, SSE) get the same arithmetic as generic vector IR - widen, multiply, add.
The only rounding is the activations' (and fp32 sums, as in exact mode): the quality cost is
measured against exact mode, not assumed (model/quality.py; chapter 04 prints it).

Measured (same setup as cpu/quant_fp32.py: one thread, best of 25, Q4_1 1536 x 576 in cache):
AVX-512 VNNI 32 us (17 GB/s of packed bytes; 43 us before both rows of a pair shared one load,
one mask and one shift), AVX2 46-61 us (9-12 GB/s), against 60-70 and 81-90 us for exact mode.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from minillm.hardware.machine import compile_target
from minillm.kernels.cpu import quant_llvm as L
from minillm.kernels.cpu.quant_fp32 import Q8_0_CODE, QTYPE_CODES, add_min_terms, store_row
from minillm.kernels.cpu.quant_repack import RepackedMatrix

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

@njit(cache=True)
def quantize_activations(x):
    """x (cols,) float32 -> codes int8 (cols,), scales float32 (blocks,), sums float32 (blocks,).

    Rounding as C's roundf (halves away from zero), as ggml's quantize_row_q8_1. The scale stays
    fp32 (ggml rounds it to fp16): nothing here is stored, so there is no reason to lose bits.
    """
    n_blocks = x.shape[0] // 32
    codes = np.empty(x.shape[0], dtype=np.int8)      # (cols,)
    scales = np.empty(n_blocks, dtype=np.float32)    # (blocks,)
    sums = np.empty(n_blocks, dtype=np.float32)      # (blocks,)
    for b in range(n_blocks):
        largest = np.float32(0.0)
        for j in range(b * 32, b * 32 + 32):
            largest = max(largest, abs(x[j]))
        d = largest / np.float32(127.0)
        inverse = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        total = 0
        for j in range(b * 32, b * 32 + 32):
            v = x[j] * inverse
            q = np.int32(np.floor(abs(v) + np.float32(0.5)))
            q = -q if v < 0 else q
            codes[j] = q
            total += q
        scales[b] = d
        sums[b] = d * np.float32(total)
    return codes, scales, sums


# -----------------------------------------------------------------------------------------------
# One row group's integer dot products

def _unsigned_codes(builder, quants, at, qtype_code, x_codes):
    """One row's block -> (32 unsigned weight codes, the 32 activation codes to multiply them by)."""
    v32 = L.vector(L.I8, 32)
    if qtype_code == Q8_0_CODE:  # the sign trick: |w| * (x with w's sign) = w * x
        w = L.load(builder, quants, at, v32)
        zero = L.constant_vector(L.I8, [0] * 32)
        negative = builder.icmp_signed("<", w, zero)
        return (builder.select(negative, builder.sub(zero, w), w),
                builder.select(negative, builder.sub(zero, x_codes), x_codes))
    nibbles = L.load(builder, quants, at, L.vector(L.I8, 16))
    low = builder.and_(nibbles, L.constant_vector(L.I8, [15] * 16))
    high = builder.lshr(nibbles, L.constant_vector(L.I8, [4] * 16))
    return L.pick(builder, low, high, range(32)), x_codes  # weights 0..15 then 16..31, as x


def _dot_8_lanes(builder, isa, u, s):
    """32 unsigned x 32 signed bytes -> <8 x i32>, lane k = the sum of products 4k..4k+3."""
    if isa == GENERIC:
        products = builder.mul(builder.zext(u, L.vector(L.I32, 32)), builder.sext(s, L.vector(L.I32, 32)))
        quarters = [L.pick(builder, products, products, range(8 * k, 8 * k + 8)) for k in range(4)]
        return builder.add(builder.add(quarters[0], quarters[1]), builder.add(quarters[2], quarters[3]))
    pairs = L.call(builder, "llvm.x86.avx2.pmadd.ub.sw", L.vector(L.I16, 16), u, s)
    ones = L.constant_vector(L.I16, [1] * 16)
    return L.call(builder, "llvm.x86.avx2.pmadd.wd", L.vector(L.I32, 8), pairs, ones)


def _dot_16_lanes(builder, isa, u, s):
    """64 unsigned x 64 signed bytes (two rows) -> <16 x i32>: lanes 0..7 the first row, 8..15 the second."""
    if isa == AVX512_VNNI:
        v16i = L.vector(L.I32, 16)
        return L.call(builder, "llvm.x86.avx512.vpdpbusd.512", v16i, L.constant_vector(L.I32, [0] * 16),
                      builder.bitcast(u, v16i), builder.bitcast(s, v16i))
    pairs = L.call(builder, "llvm.x86.avx512.pmaddubs.w.512", L.vector(L.I16, 32), u, s)
    ones = L.constant_vector(L.I16, [1] * 32)
    return L.call(builder, "llvm.x86.avx512.pmaddw.d.512", L.vector(L.I32, 16), pairs, ones)


@intrinsic
def _group_dot(typingctx, quants, scales, mins, x_codes, x_scales, x_sums, group, n_blocks, out,
               qtype_code, rows_per_group, isa):
    """out[group * R + r] = row r of the group . the quantized activations, for one group's R rows."""
    literal = (qtype_code, rows_per_group, isa)
    if not all(isinstance(t, types.IntegerLiteral) for t in literal):
        return None
    code, R, isa_code = (t.literal_value for t in literal)
    code_bytes = 32 if code == Q8_0_CODE else 16
    rows_per_vector = 2 if isa_code in (AVX512, AVX512_VNNI) else 1  # rows per 16 int32 lanes
    lanes = 8 * rows_per_vector

    def codegen(context, builder, sig, args):
        q_ptr, d_ptr, m_ptr, xq_ptr, xd_ptr, xs_ptr = (L.array_data(context, builder, sig.args[i], args[i])
                                                       for i in range(6))
        out_ptr = L.array_data(context, builder, sig.args[8], args[8])
        g, nb = args[6], args[7]
        vRf, vf = L.vector(L.F32, R), L.vector(L.F32, lanes)
        accumulators = [L.accumulator(builder, L.constant_vector(L.F32, [0.0] * lanes))
                        for _ in range(R // rows_per_vector)]
        min_terms = L.accumulator(builder, L.constant_vector(L.F32, [0.0] * R))
        with cgutils.for_range(builder, nb) as loop:
            b = loop.index
            x = L.load(builder, xq_ptr, builder.mul(b, L.index(32)), L.vector(L.I8, 32))     # (32,) int8
            first = builder.mul(builder.add(builder.mul(g, nb), b), L.index(R))
            dd = builder.fmul(L.load(builder, d_ptr, first, vRf),
                              L.splat(builder, builder.load(builder.gep(xd_ptr, [b])), R))   # (R,) d_r d_x
            if code != Q8_0_CODE:
                add_min_terms(builder, m_ptr, xs_ptr, first, b, R, min_terms)
            for v, acc in enumerate(accumulators):
                rows = range(v * rows_per_vector, (v + 1) * rows_per_vector)
                at = builder.mul(builder.add(first, L.index(rows[0])), L.index(code_bytes))
                if rows_per_vector == 1:
                    dots = _dot_8_lanes(builder, isa_code, *_unsigned_codes(builder, q_ptr, at, code, x))
                elif code == Q8_0_CODE:
                    (u0, s0), (u1, s1) = (_unsigned_codes(builder, q_ptr, builder.add(at, L.index(32 * k)), code, x)
                                          for k in range(2))
                    dots = _dot_16_lanes(builder, isa_code, L.pick(builder, u0, u1, range(64)),
                                         L.pick(builder, s0, s1, range(64)))
                else:  # both rows' nibbles in one 32-byte load, one mask, one shift
                    nibbles = L.load(builder, q_ptr, at, L.vector(L.I8, 32))
                    low = builder.and_(nibbles, L.constant_vector(L.I8, [15] * 32))
                    high = builder.lshr(nibbles, L.constant_vector(L.I8, [4] * 32))
                    u = L.pick(builder, low, high, [*range(16), *range(32, 48), *range(16, 32), *range(48, 64)])
                    dots = _dot_16_lanes(builder, isa_code, u, L.pick(builder, x, x, [*range(32), *range(32)]))
                scale = L.pick(builder, dd, dd, [r for r in rows for _ in range(8)])          # (lanes,)
                builder.store(L.fma(builder, builder.sitofp(dots, vf), scale, builder.load(acc)), acc)
        min_terms = builder.load(min_terms)
        for r in range(R):
            acc = builder.load(accumulators[r // rows_per_vector])
            k = r % rows_per_vector
            row = L.pick(builder, acc, acc, range(8 * k, 8 * k + 8))  # (8,) this row's lanes
            store_row(builder, out_ptr, g, R, r, row, L.lane(builder, min_terms, r))
        return context.get_dummy_value()

    signature = types.void(quants, scales, mins, x_codes, x_scales, x_sums, group, n_blocks, out,
                           qtype_code, rows_per_group, isa)
    return signature, codegen


@functools.cache
def _kernel(qtype_code: int, rows_per_group: int, isa: int):
    """The matvec for one code layout, R and instruction set, compiled on first use (and cached)."""
    @njit(cache=True, parallel=True)
    def matvec_kernel(quants, scales, mins, x, out):
        x_codes, x_scales, x_sums = quantize_activations(x)  # (cols,), (blocks,), (blocks,)
        n_blocks = x.shape[0] // 32
        for g in prange(out.shape[0] // rows_per_group):
            _group_dot(quants, scales, mins, x_codes, x_scales, x_sums, g, n_blocks, out,
                       qtype_code, rows_per_group, isa)

    return matvec_kernel


def kernel_for(w: RepackedMatrix, isa: int):
    return _kernel(QTYPE_CODES[w.qtype], w.rows_per_group, isa)


def matvec(x: np.ndarray, w: RepackedMatrix, isa: int | None = None) -> np.ndarray:
    """x (cols,) float32 -> (rows,) ~ W x with int8 activations; ``isa``: this target's best unless given."""
    if isa is None:
        isa = TARGET_ISA
    if isa in (AVX512, AVX512_VNNI) and w.rows_per_group % 2:
        raise ValueError(f"the {ISA_NAMES[isa]} kernel pairs rows: rows_per_group must be even, got {w.rows_per_group}")
    out = np.empty(w.groups * w.rows_per_group, dtype=np.float32)  # (padded rows,)
    kernel_for(w, isa)(w.quants, w.scales, w.mins, x, out)
    return out[:w.shape[0]]


TARGET_ISA = target_isa()
