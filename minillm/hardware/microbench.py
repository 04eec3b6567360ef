"""Microbenchmarks: how fast can this machine move bytes, find a byte, and do arithmetic?

Four questions, each answered by a small kernel and returned as dataclasses (units in the field
names), so that the command line, the chapters and the roofline all read the same figures:

- bandwidth: read / copy / triad over a working set swept from 16 KiB to 1 GiB. Small working sets
  live in L1, larger ones in L2, L3, then DRAM: the bandwidth falls in plateaus, one per level.
- latency: pointer chasing around one random cycle through the working set. Each load's address
  is the previous load's result, so nothing overlaps and no prefetcher can guess: the time per hop
  is the latency of the level the working set fits in (the staircase).
- peak FP32 FLOP/s: a BLAS matrix multiply (what NumPy gets from a tuned library) and chains of
  vector fused multiply-adds on independent accumulators (what our own compiled code can reach).
- per-call overhead: what one call costs before any work is done - Python, Numba's dispatcher,
  a NumPy ufunc, a PyTorch op. Decode runs hundreds of small operators per token; this is the tax.

Timings are the best of several repeats: noise (other processes, frequency changes) only ever makes
a run slower, so the minimum is the closest to what the hardware can do.
"""
from __future__ import annotations

import importlib.util
import math
import platform
import statistics
import time
import timeit
from dataclasses import dataclass

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from minillm.hardware.machine import Machine, compile_target

KIB, MIB, GIB = 1024, 1024**2, 1024**3
CACHE_LINE_BYTES = 64
BANDWIDTH_KERNELS = ("read", "copy", "triad")
ARRAYS_PER_KERNEL = {"read": 1, "copy": 2, "triad": 3}   # float32 arrays each kernel streams through


def sweep_sizes(smallest: int = 16 * KIB, largest: int = GIB, factor: int = 2) -> list[int]:
    """Working-set sizes smallest, smallest*factor, ... up to largest (inclusive)."""
    if smallest <= 0 or largest < smallest or factor < 2:
        raise ValueError(f"sweep_sizes needs 0 < smallest <= largest and factor >= 2, got "
                         f"smallest={smallest}, largest={largest}, factor={factor}")
    sizes = [smallest]
    while sizes[-1] * factor <= largest:
        sizes.append(sizes[-1] * factor)
    return sizes


# ----------------------------------------------------------------------------------------------
# Bandwidth: read, copy, triad
#
# Each kernel runs `reps` passes over its arrays inside compiled code, so that a 16 KiB working set
# is timed over many passes rather than one call's overhead. Threads split the arrays into one
# contiguous slice each and stream their own slice again and again: a slice stays in that core's
# private caches, so with T threads the L1 and L2 plateaus reach T times one core's capacity.
# The single-thread loops index with range(a.size), which lets LLVM vectorize them (SIMD loads).

@njit(fastmath=True, cache=True)
def _read_passes(a, reps):
    total = np.float32(0.0)
    for _ in range(reps):
        for i in range(a.size):
            total += a[i]
    return total


@njit(fastmath=True, cache=True)
def _copy_passes(src, dst, reps):
    for _ in range(reps):
        for i in range(src.size):
            dst[i] = src[i]


@njit(fastmath=True, cache=True)
def _triad_passes(a, b, c, scalar, reps):
    for _ in range(reps):
        for i in range(a.size):
            a[i] = b[i] + scalar * c[i]


@njit(parallel=True, cache=True)
def _read_kernel(a, reps, threads):
    chunk = -(-a.size // threads)
    partial = np.zeros(threads, np.float32)   # (threads,) one sum each: the result keeps the loads alive
    for t in prange(threads):
        partial[t] = _read_passes(a[t * chunk:(t + 1) * chunk], reps)
    return partial.sum()


@njit(parallel=True, cache=True)
def _copy_kernel(src, dst, reps, threads):
    chunk = -(-src.size // threads)
    for t in prange(threads):
        _copy_passes(src[t * chunk:(t + 1) * chunk], dst[t * chunk:(t + 1) * chunk], reps)


@njit(parallel=True, cache=True)
def _triad_kernel(a, b, c, scalar, reps, threads):
    chunk = -(-a.size // threads)
    for t in prange(threads):
        lo, hi = t * chunk, (t + 1) * chunk
        _triad_passes(a[lo:hi], b[lo:hi], c[lo:hi], scalar, reps)


@dataclass(frozen=True)
class BandwidthPoint:
    kernel: str               # "read" (1 array), "copy" (2 arrays), "triad" (3 arrays)
    working_set_bytes: int    # all arrays together
    bandwidth_gbs: float      # bytes read + bytes written per second, / 1e9 (STREAM's convention)
    threads: int


BUDGET_S = 0.25  # seconds of repeated timings per figure, at least (see best_time)


def measure_bandwidth(kernel: str, working_set_bytes: int, threads: int | None = None,
                      repeats: int = 10, min_bytes: int = 32 * MIB, budget_s: float = BUDGET_S) -> BandwidthPoint:
    """Stream ``working_set_bytes`` of float32 arrays through one kernel; best of ``repeats``.

    read: sum(a); copy: b[:] = a; triad: a[:] = b + s*c. Each timing moves at least ``min_bytes``
    (several passes for small working sets). Write-allocate traffic is not counted, as in STREAM.
    Many short timings rather than a few long ones, for at least ``budget_s`` seconds: on a busy
    machine, the more chances a timing has to run undisturbed, the better the best of them.
    """
    if kernel not in ARRAYS_PER_KERNEL:
        raise ValueError(f"unknown bandwidth kernel {kernel!r}; choose one of {BANDWIDTH_KERNELS}")
    threads = threads or numba.get_num_threads()
    if not 1 <= threads <= numba.get_num_threads():
        raise ValueError(f"threads must be between 1 and {numba.get_num_threads()}, got {threads}")
    n_arrays = ARRAYS_PER_KERNEL[kernel]
    n = working_set_bytes // (4 * n_arrays)   # float32 elements per array
    if n < threads:
        raise ValueError(f"working set of {working_set_bytes} bytes is too small for {threads} threads")
    arrays = [np.ones(n, np.float32) for _ in range(n_arrays)]   # n_arrays x (n,); np.ones touches every page now
    moved = 4 * n * n_arrays
    reps = max(1, math.ceil(min_bytes / moved))
    _run_bandwidth_kernel(kernel, arrays, 1, threads)   # compile (or load from cache), warm the caches
    seconds = best_time(lambda: _run_bandwidth_kernel(kernel, arrays, reps, threads), repeats, budget_s)
    return BandwidthPoint(kernel, moved, moved * reps / seconds / 1e9, threads)


def _run_bandwidth_kernel(kernel: str, arrays: list[np.ndarray], reps: int, threads: int):
    # One thread calls the plain loop: a parallel region would wait on every other pool thread at
    # its barrier, and on a busy machine that wait, not the memory, would be what we time.
    scalar = (np.float32(0.5),) if kernel == "triad" else ()
    if threads == 1:
        passes = {"read": _read_passes, "copy": _copy_passes, "triad": _triad_passes}[kernel]
        return passes(*arrays, *scalar, reps)
    parallel = {"read": _read_kernel, "copy": _copy_kernel, "triad": _triad_kernel}[kernel]
    return parallel(*arrays, *scalar, reps, threads)


def bandwidth_sweep(kernel: str = "read", sizes: list[int] | None = None, threads: int | None = None,
                    repeats: int = 10, min_bytes: int = 32 * MIB) -> list[BandwidthPoint]:
    """``measure_bandwidth`` at each working-set size (default 16 KiB, 32 KiB, ..., 1 GiB)."""
    return [measure_bandwidth(kernel, size, threads, repeats, min_bytes) for size in sizes or sweep_sizes()]


# ----------------------------------------------------------------------------------------------
# Latency: pointer chasing around one random cycle

def single_cycle_permutation(n: int, rng: np.random.Generator) -> np.ndarray:
    """A random permutation of 0..n-1 that is ONE cycle: following i -> perm[i] from any start
    visits every element before coming back (Sattolo's algorithm).

    A plain random permutation splits into several cycles, and a chase could get stuck in a short
    one that fits in L1. Sattolo's variant of the Fisher-Yates shuffle swaps element i only with an
    element j < i (never with itself), which is exactly what makes the result a single cycle.
    """
    if n < 1:
        raise ValueError(f"a permutation needs n >= 1 elements, got {n}")
    # j_i uniform in [0, i) for i = 1 .. n-1, drawn all at once; the swaps must run in order.
    swap_with = (rng.random(n - 1) * np.arange(1, n)).astype(np.int64)   # (n - 1,)
    perm = np.arange(n, dtype=np.int64)                                   # (n,)
    _sattolo_swaps(perm, swap_with)
    return perm


@njit(cache=True)
def _sattolo_swaps(perm, swap_with):
    for i in range(perm.size - 1, 0, -1):
        j = swap_with[i - 1]
        perm[i], perm[j] = perm[j], perm[i]


@njit(cache=True)
def _chase(next_index, start, hops):
    i = start
    for _ in range(hops):
        i = next_index[i]   # the next address is this load's result: no two loads overlap
    return i


@dataclass(frozen=True)
class LatencyPoint:
    working_set_bytes: int
    latency_ns: float         # per dependent load
    hops: int


def measure_latency(working_set_bytes: int, hops: int = 1 << 18, repeats: int = 5,
                    rng: np.random.Generator | None = None) -> LatencyPoint:
    """Time ``hops`` dependent loads around a random cycle through ``working_set_bytes``.

    One pointer per 64-byte cache line, so every hop lands on a different line; the lines are
    visited in the order of a single-cycle permutation. Single-threaded: latency is per core.
    """
    n_lines = working_set_bytes // CACHE_LINE_BYTES
    if n_lines < 2:
        raise ValueError(f"working set must hold at least 2 cache lines, got {working_set_bytes} bytes")
    per_line = CACHE_LINE_BYTES // 8
    next_index = np.zeros(n_lines * per_line, np.int64)     # (n_lines * 8,) = working_set_bytes
    cycle = single_cycle_permutation(n_lines, rng or np.random.default_rng(0))
    next_index[::per_line] = cycle * per_line               # line k's first word -> line cycle[k]
    _chase(next_index, 0, min(n_lines, hops))               # compile, then warm the caches
    seconds = best_time(lambda: _chase(next_index, 0, hops), repeats)
    return LatencyPoint(n_lines * CACHE_LINE_BYTES, seconds / hops * 1e9, hops)


def latency_sweep(sizes: list[int] | None = None, hops: int = 1 << 18, repeats: int = 5,
                  seed: int = 0) -> list[LatencyPoint]:
    """``measure_latency`` at each size (default 16 KiB, 32 KiB, ..., 256 MiB)."""
    rng = np.random.default_rng(seed)
    return [measure_latency(size, hops, repeats, rng) for size in sizes or sweep_sizes(16 * KIB, 256 * MIB)]


# ----------------------------------------------------------------------------------------------
# Peak FP32 FLOP/s

# Measured: an auto-vectorised Numba loop of FMAs (x[k] = x[k] * a + b over 128 lanes) reached half
# the peak on an Intel AVX-512 host (Xeon VM, LLVM cpu rocketlake): LLVM's cost model for Intel cores
# prefers 256-bit vectors in the loops it vectorises itself, and the loop compiled to ymm FMAs. So
# the vectors are written out: lanes = the compile target's widest register, as the quantized
# kernels write theirs (kernels/cpu/quant_llvm.py), and tests/test_hardware.py checks the width in
# the assembly.


def fma_chains(vector_bits: int) -> int:
    """Independent accumulators: an FMA's result comes ~4 cycles after it starts and a core has up to
    4 FMA units (Apple's), so up to 16 must be in flight; 24 of 32 registers (AVX-512, NEON), 12 of
    16 (AVX2, where 2 units x 4 cycles need 8)."""
    return 24 if vector_bits == 512 or platform.machine() in ("arm64", "aarch64") else 12


@intrinsic
def _fma_vectors(typingctx, iters, seed):
    """Starting from x_c = (seed + c) / 1000 in every lane, chains c = 0..CHAINS-1 of `lanes` float32
    each: x_c = x_c * a + b, iters times; returns the sum of every lane (so no FMA is dead code).
    ``2 * CHAINS * lanes * iters`` FLOP."""
    target = compile_target()
    lanes, chains = target.vector_bits // 32, fma_chains(target.vector_bits)
    vector = ir.VectorType(ir.FloatType(), lanes)
    fma_type = ir.FunctionType(vector, [vector] * 3)

    def codegen(context, builder, sig, args):
        iters_value, seed_value = args
        fma = cgutils.get_or_insert_function(builder.module, fma_type, f"llvm.fma.v{lanes}f32")

        def splat(value: float) -> ir.Constant:
            return ir.Constant(vector, [value] * lanes)

        a, b = splat(0.999999), splat(1e-7)
        start = builder.sitofp(seed_value, ir.FloatType())
        x = []
        for c in range(chains):
            value = builder.fmul(builder.fadd(start, ir.Constant(ir.FloatType(), float(c))),
                                 ir.Constant(ir.FloatType(), 1e-3))
            lane_values = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
            broadcast = builder.shuffle_vector(lane_values, ir.Constant(vector, ir.Undefined),
                                               ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))
            x.append(cgutils.alloca_once_value(builder, broadcast))  # a register once mem2reg has run
        with cgutils.for_range(builder, iters_value):
            for chain in x:                       # the hot loop: `chains` independent vector FMAs
                builder.store(builder.call(fma, [builder.load(chain), a, b]), chain)
        total = builder.load(x[0])
        for chain in x[1:]:
            total = builder.fadd(total, builder.load(chain))
        reduce_type = ir.FunctionType(ir.FloatType(), [ir.FloatType(), vector])
        reduce = cgutils.get_or_insert_function(builder.module, reduce_type, f"llvm.vector.reduce.fadd.v{lanes}f32")
        return builder.call(reduce, [ir.Constant(ir.FloatType(), 0.0), total])

    return types.float32(types.int64, types.int64), codegen


def fma_flop_per_call(iters: int) -> int:
    target = compile_target()
    return 2 * fma_chains(target.vector_bits) * (target.vector_bits // 32) * iters


@njit(parallel=True, cache=True)
def _fma_kernel(iters, threads):
    partial = np.zeros(threads, np.float32)   # (threads,)
    for t in prange(threads):
        partial[t] = _fma_vectors(iters, t)
    return partial.sum()


@dataclass(frozen=True)
class PeakFlops:
    method: str               # "numpy matmul (BLAS)" or "numba FMA vectors"
    gflops: float             # 1e9 floating-point operations per second (an FMA counts as 2)
    threads: int | None       # None: the BLAS library chooses


def gemm_flops(n: int = 1024, repeats: int = 10, budget_s: float = BUDGET_S) -> PeakFlops:
    """FP32 ``a @ b`` with n x n matrices through NumPy's BLAS: 2 n^3 FLOP."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)   # (n, n)
    b = rng.standard_normal((n, n), dtype=np.float32)   # (n, n)
    a @ b   # the BLAS library starts its threads on the first call
    seconds = best_time(lambda: a @ b, repeats, budget_s)  # threaded BLAS: the same barrier problem
    return PeakFlops("numpy matmul (BLAS)", 2 * n**3 / seconds / 1e9, None)


def fma_flops(iters: int = 1 << 18, threads: int | None = None, repeats: int = 30,
              budget_s: float = BUDGET_S) -> PeakFlops:
    """Chains of vector FMAs on independent accumulators (``_fma_vectors``), one copy per thread."""
    threads = threads or numba.get_num_threads()
    if not 1 <= threads <= numba.get_num_threads():
        raise ValueError(f"threads must be between 1 and {numba.get_num_threads()}, got {threads}")
    _fma_kernel(1, threads)
    seconds = best_time(lambda: _fma_kernel(iters, threads), repeats, budget_s)
    return PeakFlops("numba FMA vectors", fma_flop_per_call(iters) * threads / seconds / 1e9, threads)


# ----------------------------------------------------------------------------------------------
# Peak int8 multiply-adds: the roof of int8 mode's integer dot products (kernels/cpu/quant_int8.py)

def int8_dot_instruction() -> str | None:
    """The multiply-add of bytes (unsigned x signed) the int8 kernels are built on for this target:
    "vpdpbusd" (AVX-512 VNNI: 4 products summed into each int32 lane), "vpmaddubsw" (AVX2 and
    AVX-512 without VNNI: 2 products into each int16 lane), or None (other targets, where the kernels
    are generic vector code and have no such roof)."""
    target = compile_target()
    if target.isa == "avx512" and target.vnni:
        return "vpdpbusd"
    return "vpmaddubsw" if target.isa in ("avx2", "avx512") else None


INT8_DOT_SIGNED = 3  # vpdpbusd's signed operand, in every byte


def int8_dot_operand(chain: int) -> int:
    """The unsigned bytes chain ``chain`` multiplies by (every byte alike)."""
    return (5 * chain + 1) % 127


@intrinsic
def _int8_dot_vectors(typingctx, iters, seed):
    """Chains c = 0..CHAINS-1 of the target's byte multiply-add, each feeding its own next step:
    vpdpbusd acc_c += u_c . s (the accumulator is an operand), or acc_c = vpmaddubsw(u_c, acc_c's
    bytes) (its result as the next step's signed bytes, so no step can be hoisted out of the loop);
    returns the lanes' sum, so that nothing is dead code. Products per call: ``int8_macs_per_call``."""
    target = compile_target()
    bits, chains = target.vector_bits, fma_chains(target.vector_bits)
    vnni = int8_dot_instruction() == "vpdpbusd"
    i8, i16, i32 = (ir.VectorType(ir.IntType(w), bits // w) for w in (8, 16, 32))
    acc_type = i32 if vnni else i16
    if vnni:
        name, signature = "llvm.x86.avx512.vpdpbusd.512", ir.FunctionType(i32, [i32, i32, i32])
    else:
        name = "llvm.x86.avx512.pmaddubs.w.512" if bits == 512 else "llvm.x86.avx2.pmadd.ub.sw"
        signature = ir.FunctionType(i16, [i8, i8])

    def codegen(context, builder, sig, args):
        iters_value, seed_value = args
        dot = cgutils.get_or_insert_function(builder.module, signature, name)
        start = builder.trunc(seed_value, ir.IntType(8))
        u = [builder.bitcast(ir.Constant(i8, [int8_dot_operand(c)] * (bits // 8)), acc_type if vnni else i8)
             for c in range(chains)]
        s = builder.bitcast(ir.Constant(i8, [INT8_DOT_SIGNED] * (bits // 8)), acc_type) if vnni else None
        acc = []
        for c in range(chains):  # every byte of chain c starts at seed + c
            byte = builder.insert_element(ir.Constant(i8, ir.Undefined), builder.add(start, ir.Constant(ir.IntType(8), c)),
                                          ir.Constant(ir.IntType(32), 0))
            splat = builder.shuffle_vector(byte, ir.Constant(i8, ir.Undefined),
                                           ir.Constant(ir.VectorType(ir.IntType(32), bits // 8), [0] * (bits // 8)))
            acc.append(cgutils.alloca_once_value(builder, builder.bitcast(splat, acc_type)))
        with cgutils.for_range(builder, iters_value):
            for c, chain in enumerate(acc):      # the hot loop: `chains` independent multiply-adds
                value = builder.load(chain)
                step = (builder.call(dot, [value, u[c], s]) if vnni
                        else builder.call(dot, [u[c], builder.bitcast(value, i8)]))
                builder.store(step, chain)
        total = builder.load(acc[0])
        for chain in acc[1:]:
            total = builder.add(total, builder.load(chain))
        wide = builder.sext(total, ir.VectorType(ir.IntType(64), acc_type.count))
        reduce = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(64), [wide.type]), f"llvm.vector.reduce.add.v{acc_type.count}i64")
        return builder.call(reduce, [wide])

    return types.int64(types.int64, types.int64), codegen


def int8_macs_per_call(iters: int) -> int:
    """Byte products (multiply-adds) of one ``_int8_dot_vectors`` call: a vector's bytes per instruction."""
    target = compile_target()
    return fma_chains(target.vector_bits) * (target.vector_bits // 8) * iters


@njit(parallel=True, cache=True)
def _int8_dot_kernel(iters, threads):
    partial = np.zeros(threads, np.int64)   # (threads,)
    for t in prange(threads):
        partial[t] = _int8_dot_vectors(iters, t)
    return partial.sum()


@dataclass(frozen=True)
class PeakInt8:
    instruction: str          # "vpdpbusd" or "vpmaddubsw"
    gops: float               # 1e9 integer operations per second (a multiply-add of two bytes counts as 2)
    threads: int


def int8_dot_ops(iters: int = 1 << 18, threads: int | None = None, repeats: int = 30,
                 budget_s: float = BUDGET_S) -> PeakInt8:
    """Chains of the target's byte multiply-add on independent accumulators, one copy per thread (as
    ``fma_flops``): the roof for int8 mode's kernels, which also unpack codes and convert sums."""
    instruction = int8_dot_instruction()
    if instruction is None:
        raise ValueError(f"no integer multiply-add of bytes on this target ({compile_target().isa}): "
                         f"the int8 kernels run generic vector code here")
    threads = threads or numba.get_num_threads()
    if not 1 <= threads <= numba.get_num_threads():
        raise ValueError(f"threads must be between 1 and {numba.get_num_threads()}, got {threads}")
    _int8_dot_kernel(1, threads)
    seconds = best_time(lambda: _int8_dot_kernel(iters, threads), repeats, budget_s)
    return PeakInt8(instruction, 2 * int8_macs_per_call(iters) * threads / seconds / 1e9, threads)


# ----------------------------------------------------------------------------------------------
# Per-call overhead

@njit(cache=True)
def _numba_noop(x):
    return x


def _python_noop(x):
    return x


@dataclass(frozen=True)
class CallOverhead:
    what: str
    latency_ns: float         # per call, the cost of the timing loop itself subtracted


def call_overheads(calls: int = 100_000, repeats: int = 5) -> list[CallOverhead]:
    """Time ``calls`` back-to-back calls of near-empty functions: pure overhead, no work.

    A PyTorch op is included when torch is installed (importing it takes a second or two).
    """
    tiny = np.ones(8, np.float32)   # (8,)
    out = np.empty(8, np.float32)    # (8,)
    _numba_noop(1)
    cases = [
        ("python function call", lambda: _python_noop(1)),
        ("numba function call (dispatch)", lambda: _numba_noop(1)),
        ("numpy ufunc, 8 floats (np.add)", lambda: np.add(tiny, tiny, out=out)),
    ]
    if importlib.util.find_spec("torch") is not None:
        import torch

        t_tiny, t_out = torch.ones(8), torch.empty(8)
        cases.append(("torch op, 8 floats (torch.add)", lambda: torch.add(t_tiny, t_tiny, out=t_out)))
    loop = min(timeit.repeat("pass", number=calls, repeat=repeats))
    results = []
    for what, call in cases:
        seconds = min(timeit.repeat(call, number=calls, repeat=repeats))
        results.append(CallOverhead(what, max(seconds - loop, 0.0) / calls * 1e9))
    return results


# ----------------------------------------------------------------------------------------------
# From a sweep to one figure per memory level

def level_capacities(machine: Machine, threads: int = 1) -> dict[str, int]:
    """Bytes that fit in each cache level when ``threads`` threads split the working set.

    A private cache (one per core) contributes one instance per thread; a shared cache (L3) one
    instance per group of CPUs sharing it.
    """
    return {
        f"L{cache.level}": cache.size_bytes * math.ceil(threads / cache.shared_by_cpus)
        for cache in machine.data_caches()
    }


def per_level(points: list[BandwidthPoint] | list[LatencyPoint], capacities: dict[str, int],
              value: str, reduce=max) -> dict[str, float]:
    """One figure per level ("L1", "L2", "L3", "DRAM") from a sweep.

    A point counts for a cache level when its working set is at most half that level (so it fits,
    with room for everything else) and over twice the level below (so that level cannot hold most
    of it); for DRAM when it is at least 4x the last cache. Points in between are transitions.
    ``reduce`` combines the points of a level: max for bandwidth (the ceiling), median for latency.
    """
    figures, below = {}, 0
    for level, capacity in capacities.items():
        inside = [getattr(p, value) for p in points if 2 * below < p.working_set_bytes <= capacity // 2]
        if inside:
            figures[level] = reduce(inside)
        below = capacity
    dram = [getattr(p, value) for p in points if p.working_set_bytes >= 4 * below]
    if dram:
        figures["DRAM"] = reduce(dram)
    return figures


def bandwidth_by_level(points: list[BandwidthPoint], machine: Machine) -> dict[str, float]:
    """The best bandwidth (GB/s) seen in each level's plateau."""
    return per_level(points, level_capacities(machine, points[0].threads), "bandwidth_gbs", max)


def latency_by_level(points: list[LatencyPoint], machine: Machine) -> dict[str, float]:
    """The median latency (ns) in each level's plateau (single-threaded: one core's caches)."""
    return per_level(points, level_capacities(machine, 1), "latency_ns", statistics.median)


def best_time(run, repeats: int, budget_s: float = 0.0) -> float:
    """Seconds of the fastest call of ``run()``: at least ``repeats`` calls, and more until
    ``budget_s`` seconds have passed. On a machine shared with other work, a multi-threaded call
    that finishes in under a millisecond (an L3-sized read) is timed whole only when every thread
    kept its core throughout; one preempted thread makes the others wait at the barrier for a
    scheduler time slice (milliseconds), so a fixed handful of repeats can all be disturbed and
    report a fraction of the true bandwidth. Calls until a time budget leave enough of them that
    some run undisturbed: the best of them is what the hardware can do."""
    best, calls, start = math.inf, 0, time.perf_counter()
    while calls < repeats or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
        calls += 1
    return best
