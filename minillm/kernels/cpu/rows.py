"""Row-wise operators on the CPU as Numba kernels: rms_norm, rope, silu/swiglu, softmax, and exp.

Each operator reads its input once and writes its output once (NumPy's version of rms_norm
makes five passes over memory: square, mean, sqrt, divide, scale). Each comes as a per-row
function and two drivers: a serial one for the small decode shapes, where starting the
threads (a few microseconds) would cost more than the work, and a prange one for prefill.
cpu/__init__.py picks between them with PARALLEL_MIN_ELEMENTS.

fastmath: the flags below let LLVM reorder additions (so sums vectorise) and use FMAs, but
keep IEEE infinities and NaNs meaningful (no "ninf"/"nnan"), because softmax must accept
-inf logits (masked tokens) and give them probability exactly 0.

Except where two code paths must agree bit for bit. The fused decode layer (cpu/fused_decode.py)
and the per-op forward call rms_norm and the paged attention kernels from different compiled
callers, and a sum LLVM may reorder is added in whatever order each compile chose: a kernel compiled
in the process and the same kernel loaded from Numba's disk cache (where it was linked into its
caller otherwise) summed a softmax's weights differently - one ulp, on one head of SmolLM2, which
int8 mode's rounding of the activations turned into logits 0.4 apart. Those kernels take ORDERED:
no reassociation, their sums written out in a fixed order (``fixed_order_sum``, ``fixed_order_dot``), and their maxima
(exact in any order) left to the FAST flags (``row_max``).
"""
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from minillm.hardware.machine import compile_target
from minillm.kernels.cpu import quant_llvm as L

FAST = {"nsz", "arcp", "contract", "afn", "reassoc"}
# error_model="numpy": x / 0 gives inf as in NumPy. Numba's default (Python's) tests every
# division for zero to raise ZeroDivisionError, and that branch stops the loop from vectorising.
KERNEL = {"cache": True, "fastmath": FAST, "error_model": "numpy"}
# FMAs only: every other operation rounds where the source says (see the module docstring)
ORDERED = {"cache": True, "fastmath": {"contract"}, "error_model": "numpy"}
LANES = max(4, compile_target().vector_bits // 32)  # floats per vector register of the target
PARALLEL_MIN_ELEMENTS = 1 << 15  # below ~32k floats one core finishes before threads would start
SOFTMAX_CHUNK = 256              # the online softmax rescales its running sum once per chunk

# -----------------------------------------------------------------------------
# exp that vectorises
#
# LLVM can only call the C library's scalar expf, one element at a time (Numba has no vector
# math library here). This exp is arithmetic only, so a loop over it becomes vector code:
#   exp(x) = 2**n * exp(r),  n = round(x / ln 2),  r = x - n ln 2 in [-ln2/2, ln2/2]
# exp(r) by a degree-7 polynomial (Cephes' expf, relative error < 2e-7); 2**n is built directly
# as the bits of a float32 (exponent field n + 127, mantissa 0). ln 2 is split in two constants
# (Cody-Waite) so that r keeps full precision.

EXP_LO = np.float32(-87.33)  # exp(-87.33) ~ 2**-126, the smallest normal float32: below it return 0
EXP_HI = np.float32(88.37)   # exp(88.37) ~ 2**127.5, half an octave from the largest: above it return inf


FLOATS = {32: (types.float32, ir.FloatType()), 64: (types.float64, ir.DoubleType())}
INTS = {32: (types.int32, ir.IntType(32)), 64: (types.int64, ir.IntType(64))}


def _bitcast(value, kind, targets):
    """An intrinsic's (signature, codegen) reading ``value``'s bits as the ``targets`` type of its
    width (C's union trick; one no-op instruction, for a vector of them too), or None if ``value``
    is not a ``kind`` of a width targets holds."""
    if not isinstance(value, kind) or value.bitwidth not in targets:
        return None
    result, llvm_type = targets[value.bitwidth]

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], llvm_type)
    return result(value), codegen


@intrinsic
def float_from_bits(typingctx, bits):
    """An integer's bits as the float of its width: int32 -> float32, int64 -> float64."""
    return _bitcast(bits, types.Integer, FLOATS)


@intrinsic
def bits_from_float(typingctx, x):
    """A float's bits as the integer of its width: float32 -> int32, float64 -> int64. Where AVX2
    has no vector float64 -> int64 conversion (LLVM converts lane by lane), this is free."""
    return _bitcast(x, types.Float, INTS)


@intrinsic
def float32_max(typingctx, a, b):
    """max(a, b) as LLVM's maxnum: unlike Python's max, a loop of these vectorises into a max-reduction."""
    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        maxnum = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, f32]), "llvm.maxnum.f32")
        return builder.call(maxnum, args)
    return types.float32(types.float32, types.float32), codegen


@njit(cache=True, fastmath={"contract"}, error_model="numpy")  # no reassociation: it would undo the Cody-Waite split
def fast_exp(x):
    """exp(x) for float32 x; vectorises inside a loop."""
    xc = min(max(x, EXP_LO), EXP_HI)
    n = np.floor(xc * np.float32(1.4426950408889634) + np.float32(0.5))  # round(x / ln 2), a float32
    r = xc - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)  # x - n ln 2, in two steps
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)                                      # exp(r)
    y = p * float_from_bits(np.int32((np.int32(n) + np.int32(127)) << np.int32(23)))  # * 2**n
    if x < EXP_LO:
        return np.float32(0.0)
    if x > EXP_HI:
        return np.float32(np.inf)
    return y


@njit(**KERNEL)
def exp_rows(x):
    """fast_exp over a 1-D array (used by the tests to check fast_exp against np.exp)."""
    out = np.empty_like(x)  # (N,)
    for i in range(x.shape[0]):
        out[i] = fast_exp(x[i])
    return out


# -----------------------------------------------------------------------------
# sums in a fixed order, and the maximum
#
# LANES running sums in one vector register (lane k takes elements k, k + LANES, ...), the lanes then
# added in order, then the elements past the last whole vector: the order is the code's, so every
# compile of every caller rounds alike. One accumulator costs an add's latency per vector (~4
# cycles a 16 floats); the rows summed here are at most a few thousand floats.


def _fixed_order_codegen(products: bool):
    """Codegen of the sum of x (products False) or of x * y (each product fused into its addition)."""
    def codegen(context, builder, signature, args):
        x_ptr = L.array_data(context, builder, signature.args[0], args[0])
        y_ptr = L.array_data(context, builder, signature.args[-1], args[-1])
        n = L.array_shape(context, builder, signature.args[0], args[0], 0)
        vec = L.vector(L.F32, LANES)

        def add(acc, at, value_type):  # acc + x[at] (or + x[at] * y[at]): a vector or a scalar
            x = L.load(builder, x_ptr, at, value_type)
            if not products:
                return builder.fadd(acc, x)
            fma = f"llvm.fma.v{LANES}f32" if value_type is vec else "llvm.fma.f32"
            return L.call(builder, fma, value_type, x, L.load(builder, y_ptr, at, value_type), acc)

        lanes = L.accumulator(builder, L.constant_vector(L.F32, [0.0] * LANES))
        whole = builder.mul(builder.sdiv(n, L.index(LANES)), L.index(LANES))    # elements in whole vectors
        with cgutils.for_range_slice(builder, L.index(0), whole, L.index(LANES)) as (i, _):
            builder.store(add(builder.load(lanes), i, vec), lanes)
        total = L.accumulator(builder, L.horizontal_sum(builder, builder.load(lanes), ir.Constant(L.F32, 0.0)))
        with cgutils.for_range_slice(builder, whole, n, L.index(1)) as (i, _):
            builder.store(add(builder.load(total), i, L.F32), total)
        return builder.load(total)
    return codegen


def _float32_vectors(*arrays) -> bool:
    return all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype == types.float32
               for a in arrays)


@intrinsic
def fixed_order_sum(typingctx, x):
    """The sum of a 1-D C-contiguous float32 array, in the order above."""
    return (types.float32(x), _fixed_order_codegen(products=False)) if _float32_vectors(x) else None


@intrinsic
def fixed_order_dot(typingctx, x, y):
    """The sum of x[i] * y[i] over two 1-D C-contiguous float32 arrays of one length (y may be x:
    a sum of squares), in the order above, each product fused into its addition (one rounding)."""
    return (types.float32(x, y), _fixed_order_codegen(products=True)) if _float32_vectors(x, y) else None


@njit(**KERNEL)
def row_max(x):
    """The largest element of a 1-D array. A maximum rounds nothing, so its order does not matter:
    the FAST flags may vectorise it as they like (ORDERED kernels call it for their maxima)."""
    m = np.float32(-np.inf)
    for i in range(x.shape[0]):
        m = float32_max(m, x[i])
    return m


# -----------------------------------------------------------------------------
# rms_norm: one pass for the sum of squares, one to scale


@njit(**ORDERED)
def _rms_norm_row(x, weight, eps, out):
    inv_rms = np.float32(1.0) / np.sqrt(fixed_order_dot(x, x) / np.float32(x.shape[0]) + eps)
    for i in range(x.shape[0]):
        out[i] = x[i] * inv_rms * weight[i]


@njit(**ORDERED)
def rms_norm_serial(x, weight, eps):
    """x (T, D) C-contiguous (cpu.rms_norm makes it so)."""
    out = np.empty_like(x)  # (T, D)
    for t in range(x.shape[0]):
        _rms_norm_row(x[t], weight, eps, out[t])
    return out


@njit(parallel=True, **ORDERED)
def rms_norm_parallel(x, weight, eps):
    out = np.empty_like(x)  # (T, D)
    for t in prange(x.shape[0]):
        _rms_norm_row(x[t], weight, eps, out[t])
    return out


# -----------------------------------------------------------------------------
# rope, in place: x (T, H, Dh) is rotated where it lies


@njit(**KERNEL)
def _rope_token(x, cos, sin, half_style):
    """Rotate every head of one token, x (H, Dh), by the angles cos/sin (Dh/2,)."""
    half = x.shape[1] // 2
    for h in range(x.shape[0]):
        for i in range(half):
            a_at, b_at = (i, i + half) if half_style else (2 * i, 2 * i + 1)
            a, b = x[h, a_at], x[h, b_at]
            x[h, a_at] = a * cos[i] - b * sin[i]
            x[h, b_at] = b * cos[i] + a * sin[i]


@njit(**KERNEL)
def _positions_fit(positions, n_positions):
    """All positions index a row of the tables: checked in the kernel, where it costs nothing
    (two NumPy reductions in Python cost more than rotating a decode token)."""
    for t in range(positions.shape[0]):
        if positions[t] < 0 or positions[t] >= n_positions:
            return False
    return True


@njit(**KERNEL)
def rope_serial(x, positions, cos, sin, half_style):
    """Rotates x in place; False (x untouched) if a position lies outside the tables."""
    if not _positions_fit(positions, cos.shape[0]):
        return False
    for t in range(x.shape[0]):
        _rope_token(x[t], cos[positions[t]], sin[positions[t]], half_style)
    return True


@njit(parallel=True, **KERNEL)
def rope_parallel(x, positions, cos, sin, half_style):
    if not _positions_fit(positions, cos.shape[0]):
        return False
    for t in prange(x.shape[0]):
        _rope_token(x[t], cos[positions[t]], sin[positions[t]], half_style)
    return True


# -----------------------------------------------------------------------------
# silu and swiglu: one read of each input, one write


@njit(**KERNEL)
def _swiglu_row(gate, up, out):
    for i in range(gate.shape[0]):
        g = gate[i]
        out[i] = g / (np.float32(1.0) + fast_exp(-g)) * up[i]


# gate and up usually arrive as the two column halves of one (T, 2F) projection: rows contiguous,
# the arrays not. A row of such an array does not vectorise (Numba types it with an unknown
# stride), so each row is copied first - into cache, by the thread that uses it; a no-op for
# contiguous arrays. At 512 x 1536 (2-core Xeon VM, 2 threads): 0.31 ms, against 0.83 ms for
# copying both halves whole first (one thread, through memory) and 7.8 ms for the strided rows
# (2-core Zen 4).
@njit(**KERNEL)
def swiglu_serial(gate, up):
    out = np.empty(gate.shape, dtype=np.float32)  # (T, F)
    for t in range(gate.shape[0]):
        _swiglu_row(np.ascontiguousarray(gate[t]), np.ascontiguousarray(up[t]), out[t])
    return out


@njit(parallel=True, **KERNEL)
def swiglu_parallel(gate, up):
    out = np.empty(gate.shape, dtype=np.float32)  # (T, F)
    for t in prange(gate.shape[0]):
        _swiglu_row(np.ascontiguousarray(gate[t]), np.ascontiguousarray(up[t]), out[t])
    return out


@njit(**KERNEL)
def silu_flat(x):
    """silu over a contiguous 1-D array (silu is swiglu with up = 1)."""
    out = np.empty_like(x)  # (N,)
    for i in range(x.shape[0]):
        out[i] = x[i] / (np.float32(1.0) + fast_exp(-x[i]))
    return out


# -----------------------------------------------------------------------------
# softmax, online: the running max and sum are found in one pass


@njit(**KERNEL)
def _softmax_row(x, out, chunk_m):
    """One pass over x in chunks keeps a running max m and the sum s of exp(x - m): when a chunk
    raises the max, s is rescaled by exp(m_old - m_new). Each chunk's exp(x - m) is written to
    out at once, with the m it used; a second pass only multiplies each chunk by
    exp(m_chunk - m_final) / s. One exp per element instead of two, and no separate max pass.
    """
    n_chunks = chunk_m.shape[0]  # chunk_m (n_chunks,) receives the max each chunk was shifted by
    m = np.float32(-np.inf)
    s = np.float32(0.0)
    for c in range(n_chunks):
        xc = x[c * SOFTMAX_CHUNK:(c + 1) * SOFTMAX_CHUNK]    # (<= CHUNK,) views: loops from 0
        oc = out[c * SOFTMAX_CHUNK:(c + 1) * SOFTMAX_CHUNK]  # vectorise without index checks
        chunk_max = xc[0]
        for i in range(xc.shape[0]):
            chunk_max = float32_max(chunk_max, xc[i])
        if chunk_max > m:
            s *= fast_exp(m - chunk_max)  # exp(-inf) = 0 on the first chunk
            m = chunk_max
        chunk_m[c] = m
        if m == -np.inf:  # every logit so far is -inf (masked): they get probability 0
            oc[:] = 0.0
            continue
        for i in range(xc.shape[0]):
            e = fast_exp(xc[i] - m)
            oc[i] = e
            s += e
    inv_s = np.float32(1.0) / s
    for c in range(n_chunks):
        oc = out[c * SOFTMAX_CHUNK:(c + 1) * SOFTMAX_CHUNK]
        rescale = fast_exp(chunk_m[c] - m) * inv_s
        for i in range(oc.shape[0]):
            oc[i] *= rescale


@njit(**KERNEL)
def softmax_serial(x):
    out = np.empty_like(x)  # (R, N)
    chunk_m = np.empty((x.shape[0], (x.shape[1] + SOFTMAX_CHUNK - 1) // SOFTMAX_CHUNK), dtype=np.float32)
    for r in range(x.shape[0]):
        _softmax_row(x[r], out[r], chunk_m[r])
    return out


@njit(parallel=True, **KERNEL)
def softmax_parallel(x):
    out = np.empty_like(x)  # (R, N)
    chunk_m = np.empty((x.shape[0], (x.shape[1] + SOFTMAX_CHUNK - 1) // SOFTMAX_CHUNK), dtype=np.float32)
    for r in prange(x.shape[0]):
        _softmax_row(x[r], out[r], chunk_m[r])
    return out
