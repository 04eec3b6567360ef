"""Integer mode (opt-in): activations quantized to int8 blocks, dot products in integers.

As llama.cpp does on CPUs: each activation row is quantized once per linear, per block of 32, to
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

With T rows of x (a few decoding streams, a speculative verify of k + 1 tokens) each weight block
is loaded and unpacked once and feeds T integer dot products, as quant_fp32.matvec_rows does in
exact mode. The per-row arithmetic does not depend on T (same operations, same order), so row t
of a T-row call is bit for bit what a one-row call gives for x[t]: one kernel serves both.

Measured (same setup as cpu/quant_fp32.py: one thread, best of 25, Q4_1 1536 x 576 in cache):
AVX-512 VNNI 32 us (17 GB/s of packed bytes; 43 us before both rows of a pair shared one load,
one mask and one shift), AVX2 46-61 us (9-12 GB/s), against 60-70 and 81-90 us for exact mode.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import literally, njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from minillm.hardware.machine import compile_target
from minillm.kernels.cpu import quant_llvm as L
from minillm.kernels.cpu.quant_fp32 import Q8_0_CODE, QTYPE_CODES, add_min_terms, prefetch_ahead, store_row
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


def rows_per_vector(isa: int) -> int:
    """Weight rows that share one vector of 16 int32 lanes: two on AVX-512, one (8 lanes) elsewhere."""
    return 2 if isa in (AVX512, AVX512_VNNI) else 1


def rows_per_pass(R: int, T: int, isa: int) -> int:
    """Rows of a group handled per pass over the blocks when x has T rows. Each (row vector, row of
    x) pair keeps one running sum in a register: 16 of the 32 zmm registers on AVX-512, 8 of the 16
    ymm on AVX2, beside the T activation blocks and the unpacked codes. At T = 1 a pass is the
    whole group. A pass re-reads only the activations (from L1): every weight is still read once."""
    per_vector = rows_per_vector(isa)
    budget = 8 if per_vector == 2 else 4
    rows = R
    while rows // 2 >= per_vector and (rows // 2) % per_vector == 0 and (rows // per_vector) * T > budget:
        rows //= 2
    return rows


# -----------------------------------------------------------------------------------------------
# Quantizing the activations (the NumPy model in the tests does the same float32 operations)

@njit(cache=True)
def quantize_activations(x):
    """x (T, cols) float32 -> codes int8 (T, cols), scales float32 (T, blocks), sums float32 (T, blocks).

    Rounding as C's roundf (halves away from zero), as ggml's quantize_row_q8_1. The scale stays
    fp32 (ggml rounds it to fp16): nothing here is stored, so there is no reason to lose bits.
    """
    T, n_blocks = x.shape[0], x.shape[1] // 32
    codes = np.empty(x.shape, dtype=np.int8)              # (T, cols)
    scales = np.empty((T, n_blocks), dtype=np.float32)    # (T, blocks)
    sums = np.empty((T, n_blocks), dtype=np.float32)      # (T, blocks)
    for t in range(T):
        for b in range(n_blocks):
            largest = np.float32(0.0)
            for j in range(b * 32, b * 32 + 32):
                largest = max(largest, abs(x[t, j]))
            d = largest / np.float32(127.0)
            inverse = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            total = 0
            for j in range(b * 32, b * 32 + 32):
                v = x[t, j] * inverse
                q = np.int32(np.floor(abs(v) + np.float32(0.5)))
                q = -q if v < 0 else q
                codes[t, j] = q
                total += q
            scales[t, b] = d
            sums[t, b] = d * np.float32(total)
    return codes, scales, sums


# -----------------------------------------------------------------------------------------------
# One row group's integer dot products

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


def _unpack(builder, quants, at, code, per_vector):
    """The codes of ``per_vector`` consecutive rows' block at byte ``at`` -> (unsigned codes
    <32 * per_vector x i8>, the signed codes for the sign trick, or None for Q4).

    Q4: byte j holds weight j (low nibble) and j + 16 (high), so one mask and one shift give a
    row's weights 0..15 and 16..31; the rows of a pair share the load, the mask and the shift.
    """
    if code == Q8_0_CODE:  # the sign trick: |w| * (x with w's sign) = w * x
        w = L.load(builder, quants, at, L.vector(L.I8, 32 * per_vector))
        negative = builder.icmp_signed("<", w, L.constant_vector(L.I8, [0] * (32 * per_vector)))
        return builder.select(negative, builder.neg(w), w), w
    nibbles = L.load(builder, quants, at, L.vector(L.I8, 16 * per_vector))
    low = builder.and_(nibbles, L.constant_vector(L.I8, [15] * (16 * per_vector)))
    high = builder.lshr(nibbles, L.constant_vector(L.I8, [4] * (16 * per_vector)))
    if per_vector == 1:
        return L.pick(builder, low, high, range(32)), None
    return L.pick(builder, low, high, [*range(16), *range(32, 48), *range(16, 32), *range(48, 64)]), None


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
    code_bytes = 32 if code == Q8_0_CODE else 16
    per_vector = rows_per_vector(isa_code)
    lanes = 8 * per_vector
    per_pass = rows_per_pass(R, T, isa_code)

    def codegen(context, builder, sig, args):
        q_ptr, d_ptr, m_ptr, xq_ptr, xd_ptr, xs_ptr = (L.array_data(context, builder, sig.args[i], args[i])
                                                       for i in range(6))
        out_ptr = L.array_data(context, builder, sig.args[7], args[7])
        g = args[6]
        n_blocks = L.array_shape(context, builder, sig.args[4], args[4], 1)
        cols = builder.mul(n_blocks, L.index(32))
        padded_rows = L.array_shape(context, builder, sig.args[7], args[7], 1)
        vRf, vf = L.vector(L.F32, R), L.vector(L.F32, lanes)
        min_terms = [L.accumulator(builder, L.constant_vector(L.F32, [0.0] * R)) for _ in range(T)]
        for first_row in range(0, R, per_pass):  # each pass: its rows' accumulators, all of the blocks
            vectors = [range(v, v + per_vector) for v in range(first_row, first_row + per_pass, per_vector)]
            acc = {(v, t): L.accumulator(builder, L.constant_vector(L.F32, [0.0] * lanes))
                   for v in range(len(vectors)) for t in range(T)}
            with cgutils.for_range(builder, n_blocks) as loop:
                b = loop.index
                x, x_negated, d_x = [], [], []  # per row of x: its codes (once per pair of rows on AVX-512)
                for t in range(T):
                    codes = L.load(builder, xq_ptr, builder.add(builder.mul(L.index(t), cols), builder.mul(b, L.index(32))),
                                   L.vector(L.I8, 32))                                   # (32,) int8
                    if per_vector == 2:
                        codes = L.pick(builder, codes, codes, [*range(32), *range(32)])  # (64,) both rows'
                    x.append(codes)
                    if code == Q8_0_CODE and isa_code != AVX2:
                        x_negated.append(builder.sub(L.constant_vector(L.I8, [0] * (32 * per_vector)), codes))
                    at_t = builder.add(builder.mul(L.index(t), n_blocks), b)
                    d_x.append(L.splat(builder, builder.load(builder.gep(xd_ptr, [at_t])), lanes))
                first = builder.mul(builder.add(builder.mul(g, n_blocks), b), L.index(R))  # (group, block, row 0)
                d = L.load(builder, d_ptr, first, vRf)                                           # (R,) d_r
                if first_row == 0:  # once a block: later passes re-read the group's codes from the caches
                    prefetch_ahead(builder, q_ptr, builder.mul(first, L.index(code_bytes)), R * code_bytes)
                    if code != Q8_0_CODE:  # the minimum's share (Q8_0 has no minimum)
                        for t in range(T):
                            sums_t = builder.gep(xs_ptr, [builder.mul(L.index(t), n_blocks)])
                            add_min_terms(builder, m_ptr, sums_t, first, b, R, min_terms[t])
                for v, rows in enumerate(vectors):
                    at = builder.mul(builder.add(first, L.index(rows[0])), L.index(code_bytes))
                    u, w = _unpack(builder, q_ptr, at, code, per_vector)  # once for all T rows of x
                    d_rows = L.pick(builder, d, d, [r for r in rows for _ in range(8)])        # (lanes,)
                    if w is not None and isa_code != AVX2:
                        negative = builder.icmp_signed("<", w, L.constant_vector(L.I8, [0] * (32 * per_vector)))
                    for t in range(T):
                        if w is None:
                            s = x[t]
                        elif isa_code == AVX2:  # vpsignb: x where w > 0, -x where w < 0 (0 where w = 0, as |w| is)
                            s = L.call(builder, "llvm.x86.avx2.psign.b", L.vector(L.I8, 32), x[t], w)
                        else:
                            s = builder.select(negative, x_negated[t], x[t])
                        if per_vector == 1:
                            dots = _dot_8_lanes(builder, isa_code, u, s)
                        else:
                            dots = _dot_16_lanes(builder, isa_code, u, s)
                        scale = builder.fmul(d_rows, d_x[t])                                   # (lanes,) d_r d_x
                        builder.store(L.fma(builder, builder.sitofp(dots, vf), scale, builder.load(acc[v, t])),
                                      acc[v, t])
            for t in range(T):
                out_t = builder.gep(out_ptr, [builder.mul(L.index(t), padded_rows)])
                terms = builder.load(min_terms[t])
                for v, rows in enumerate(vectors):
                    total = builder.load(acc[v, t])
                    for k, r in enumerate(rows):
                        row = L.pick(builder, total, total, range(8 * k, 8 * k + 8))  # (8,) this row's lanes
                        store_row(builder, out_t, g, R, r, row, L.lane(builder, terms, r))
        return context.get_dummy_value()

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


def kernel_for(w: RepackedMatrix, isa: int, tokens: int = 1):
    return _kernel(QTYPE_CODES[w.qtype], w.rows_per_group, tokens, isa)


def matvec(x: np.ndarray, w: RepackedMatrix, isa: int | None = None) -> np.ndarray:
    """x (cols,) float32 -> (rows,) ~ W x with int8 activations; ``isa``: this target's best unless given."""
    return matvec_rows(x[None, :], w, isa)[0]


def matvec_rows(x: np.ndarray, w: RepackedMatrix, isa: int | None = None) -> np.ndarray:
    """x (T, cols) float32 -> (T, rows) ~ x W^T with int8 activations, each packed weight read and
    unpacked once for all T rows (x must already be checked: quant.qlinear). Row t is bit for bit
    what ``matvec(x[t])`` gives. One kernel is compiled per T: callers keep T small (qlinear: <= 8)."""
    if isa is None:
        isa = TARGET_ISA
    if rows_per_vector(isa) == 2 and w.rows_per_group % 2:
        raise ValueError(f"the {ISA_NAMES[isa]} kernel pairs rows: rows_per_group must be even, got {w.rows_per_group}")
    out = np.empty((x.shape[0], w.groups * w.rows_per_group), dtype=np.float32)  # (T, padded rows)
    kernel_for(w, isa, x.shape[0])(w.quants, w.scales, w.mins, x, out)
    return out[:, :w.shape[0]]


TARGET_ISA = target_isa()
