"""LLVM IR building blocks for the SIMD quantized kernels (cpu/quant_fp32.py, cpu/quant_int8.py).

Numba compiles Python loops through LLVM, but its auto-vectoriser does not find the shape a
quantized dot product needs (one vector load unpacked into whole lanes, one accumulator register
per row). ``numba.core.extending.intrinsic`` lets a kernel emit the IR itself: generic LLVM vector
operations (``<16 x float>``, ``<32 x i8>``), which LLVM maps onto whatever the target has - two
256-bit registers on AVX2, one 512-bit register on AVX-512, four 128-bit ones on NEON - and, where
the generic form would be slow, calls to x86 instructions by name (``llvm.x86.avx2.pmadd.ub.sw``).

``hot_loop_asm`` cuts the innermost loop out of a compiled kernel's assembly, so that chapter 04
can show what the CPU actually runs.
"""
from __future__ import annotations

import re

from llvmlite import ir
from numba.core import cgutils

F32, I8, I16, I32, I64 = ir.FloatType(), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)


def vector(element: ir.Type, lanes: int) -> ir.VectorType:
    return ir.VectorType(element, lanes)


def constant_vector(element: ir.Type, values) -> ir.Constant:
    values = list(values)
    return ir.Constant(vector(element, len(values)), values)


def index(value: int) -> ir.Constant:
    return ir.Constant(I64, value)


def array_data(context, builder, array_type, array) -> ir.Value:
    """Pointer to the first element of a Numba array argument (the kernels pass C-contiguous 1-D arrays)."""
    return cgutils.create_struct_proxy(array_type)(context, builder, value=array).data


def array_shape(context, builder, array_type, array, dim: int) -> ir.Value:
    """The length of a Numba array argument along ``dim`` (an i64)."""
    return builder.extract_value(cgutils.create_struct_proxy(array_type)(context, builder, value=array).shape, dim)


def load(builder, base: ir.Value, offset: ir.Value, vector_type: ir.Type) -> ir.Value:
    """``vector_type`` read from base + offset elements; unaligned (align 1), as the layouts only
    guarantee element alignment."""
    pointer = builder.bitcast(builder.gep(base, [offset]), vector_type.as_pointer())
    return builder.load(pointer, align=1)


def store(builder, base: ir.Value, offset: ir.Value, value: ir.Value) -> None:
    """``value`` (a vector) written at base + offset elements; unaligned, as in ``load``."""
    builder.store(value, builder.bitcast(builder.gep(base, [offset]), value.type.as_pointer()), align=1)


def widen_half(builder, bits: ir.Value) -> ir.Value:
    """fp16 numbers given as their bits (i16, or a vector of them) -> float32, exactly: one
    ``vcvtph2ps`` (F16C, on every x86 CPU with AVX2) or AArch64's ``fcvtl``. Targets without such
    an instruction must not get here (quant_repack.HALF_SCALES): there LLVM calls a runtime helper
    that Numba does not link (a segfault, seen with NUMBA_CPU_NAME=x86-64)."""
    if isinstance(bits.type, ir.VectorType):
        half, single = vector(ir.HalfType(), bits.type.count), vector(F32, bits.type.count)
    else:
        half, single = ir.HalfType(), F32
    return builder.fpext(builder.bitcast(bits, half), single)


def load_scales(builder, base: ir.Value, offset: ir.Value, lanes: int, half: bool) -> ir.Value:
    """``lanes`` float32 scales (one float for lanes == 1) from base + offset elements, widened
    from fp16 where the array keeps their bits (``half``: a uint16 array; cpu/quant_repack.py)."""
    element = I16 if half else F32
    value = load(builder, base, offset, vector(element, lanes)) if lanes > 1 else builder.load(builder.gep(base, [offset]))
    return widen_half(builder, value) if half else value


def splat(builder, value: ir.Value, lanes: int) -> ir.Value:
    """A vector of ``lanes`` copies of a scalar (one broadcast instruction)."""
    undefined = ir.Constant(vector(value.type, lanes), ir.Undefined)
    one = builder.insert_element(undefined, value, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, undefined, constant_vector(I32, [0] * lanes))


def lane(builder, v: ir.Value, i: int) -> ir.Value:
    """Lane i of a vector, as a scalar."""
    return builder.extract_element(v, ir.Constant(I32, i))


def pick(builder, a: ir.Value, b: ir.Value, lanes) -> ir.Value:
    """Lanes of the concatenation a ++ b, by index: a shufflevector."""
    return builder.shuffle_vector(a, b, constant_vector(I32, lanes))


def call(builder, name: str, result: ir.Type, *args: ir.Value) -> ir.Value:
    """Call an LLVM intrinsic (``llvm.fma.v16f32``, ``llvm.x86.avx2.pmadd.wd``, ...) by name."""
    function_type = ir.FunctionType(result, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, function_type, name), list(args))


def prefetch(builder, base: ir.Value, offset: ir.Value) -> None:
    """Ask for the cache line at base + offset bytes to be brought into every cache level (a hint:
    an address past the array's end costs nothing and does not fault)."""
    pointer = builder.bitcast(builder.gep(base, [offset]), I8.as_pointer())
    read, keep_in_all_levels, data = (ir.Constant(I32, v) for v in (0, 3, 1))
    call(builder, "llvm.prefetch.p0", ir.VoidType(), pointer, read, keep_in_all_levels, data)


def fma(builder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """a * b + c, one rounding, lane by lane."""
    return call(builder, f"llvm.fma.v{a.type.count}f32", a.type, a, b, c)


def horizontal_sum(builder, v: ir.Value, start: ir.Value) -> ir.Value:
    """start + the lanes of v, added in order (once per row, so the order's cost does not matter)."""
    return call(builder, f"llvm.vector.reduce.fadd.v{v.type.count}f32", F32, start, v)


def accumulator(builder, initial: ir.Value) -> ir.Value:
    """A stack slot for a running sum; LLVM's mem2reg turns it into a register for the whole loop."""
    return cgutils.alloca_once_value(builder, initial)


def hot_loop_asm(asm: str, marker: str) -> list[str]:
    """The instructions of the shortest loop in ``asm`` that contains an instruction matching the
    regular expression ``marker`` (e.g. "vfmadd", "vpdpbusd|vpmaddubsw"): the kernel's hot loop.

    A loop is the span from a label to a later jump back to it. Directives and comments are left out.
    """
    lines = [line.split("#")[0].strip() for line in asm.splitlines()]
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.?L\w+):", line))}
    loops = []
    for i, line in enumerate(lines):
        jump = re.match(r"^j\w+\s+(\.?L\w+)$", line)
        if jump and jump.group(1) in labels and labels[jump.group(1)] < i:
            body = [ln for ln in lines[labels[jump.group(1)]:i + 1] if ln and not ln.startswith(".")]
            if any(re.match(marker, ln) for ln in body):
                loops.append(body)
    if not loops:
        raise ValueError(f"no loop with an instruction matching {marker!r} in this assembly")
    return min(loops, key=len)
