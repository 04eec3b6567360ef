"""The GPU, if there is one: what it is (through numba-cuda) and two measurements.

- ``describe_gpu()``: streaming multiprocessors, warp size, shared memory per block, memory size and
  the theoretical memory bandwidth (memory clock x bus width x 2 for double data rate).
- ``launch_overhead()``: what one kernel launch costs, and a launch plus a wait for it to finish.
  Decode launches hundreds of small kernels per token: this overhead is a floor under every step.
- ``device_bandwidth()``: a copy kernel between two large device arrays, timed with CUDA events.
- ``event_seconds(run)``: the time of each of several calls, by CUDA events on the device (the one
  place events are recorded; chapter 03's kernel timings and the bandwidth copy both use it).
- ``fp32_peak_flops()``: SMs x FP32 lanes per SM x 2 x clock, from the architecture's lane count.

Without a usable GPU every function returns None and ``gpu_status()`` says why: no driver, no
device, or the CUDA simulator (NUMBA_ENABLE_CUDASIM=1), which runs kernels on the CPU in Python and
has no hardware to measure. Nothing here ever raises because a machine lacks a GPU.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import config, cuda

from minillm.hardware.microbench import best_time


@dataclass(frozen=True)
class GpuInfo:
    name: str
    compute_capability: tuple[int, int]
    sm_count: int                             # streaming multiprocessors
    warp_size: int                            # threads that execute in lockstep (32 on NVIDIA)
    shared_memory_per_block_bytes: int
    memory_bytes: int
    memory_clock_khz: int | None              # None where the driver no longer reports it
    memory_bus_width_bits: int | None
    theoretical_bandwidth_gbs: float | None   # 2 x clock x bus width: data moves on both clock edges


@dataclass(frozen=True)
class LaunchOverhead:
    launch_us: float                # per launch of an empty kernel, launches queued back to back
    launch_and_sync_us: float       # one launch and cuda.synchronize(): the round trip


@dataclass(frozen=True)
class DeviceBandwidth:
    bytes_moved: int                # read + written per copy
    bandwidth_gbs: float
    fraction_of_theoretical: float | None


def gpu_status() -> str:
    """The word "available", or the reason there is no GPU to describe or measure."""
    if config.ENABLE_CUDASIM:
        return "the CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1): kernels run on the CPU, no GPU to measure"
    try:
        if cuda.is_available():
            return "available"
    except Exception as error:   # a broken driver install must not take `minillm hw` down
        return f"CUDA driver error: {error}"
    return "no CUDA GPU found (numba.cuda.is_available() is False)"


def gpu_available() -> bool:
    return gpu_status() == "available"


def describe_gpu() -> GpuInfo | None:
    """The current CUDA device, or None without a GPU."""
    if not gpu_available():
        return None
    device = cuda.get_current_device()
    _, total = cuda.current_context().get_memory_info()
    clock_khz = _device_attribute(device, "MEMORY_CLOCK_RATE")
    bus_bits = _device_attribute(device, "GLOBAL_MEMORY_BUS_WIDTH")
    bandwidth = 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else None
    name = device.name.decode() if isinstance(device.name, bytes) else str(device.name)
    return GpuInfo(
        name=name,
        compute_capability=tuple(device.compute_capability),
        sm_count=device.MULTIPROCESSOR_COUNT,
        warp_size=device.WARP_SIZE,
        shared_memory_per_block_bytes=device.MAX_SHARED_MEMORY_PER_BLOCK,
        memory_bytes=int(total),
        memory_clock_khz=clock_khz,
        memory_bus_width_bits=bus_bits,
        theoretical_bandwidth_gbs=bandwidth,
    )


def launch_overhead(launches: int = 2000, repeats: int = 5) -> LaunchOverhead | None:
    """Time empty-kernel launches; None without a GPU."""
    if not gpu_available():
        return None
    empty, _ = _kernels()
    empty[1, 1]()   # compile and load the module
    cuda.synchronize()

    def queued():
        for _ in range(launches):
            empty[1, 1]()
        cuda.synchronize()

    def round_trips():
        for _ in range(launches):
            empty[1, 1]()
            cuda.synchronize()

    return LaunchOverhead(
        launch_us=best_time(queued, repeats) / launches * 1e6,
        launch_and_sync_us=best_time(round_trips, repeats) / launches * 1e6,
    )


def device_bandwidth(n_bytes: int = 1 << 30, repeats: int = 5) -> DeviceBandwidth | None:
    """Copy ``n_bytes`` / 2 of float32 from one device array to another; None without a GPU."""
    if not gpu_available():
        return None
    _, copy = _kernels()
    n = n_bytes // 8                          # float32 elements per array (two arrays)
    src = cuda.to_device(np.ones(n, np.float32))   # (n,) on the device
    dst = cuda.device_array(n, np.float32)         # (n,)
    threads = 256
    blocks = min(math.ceil(n / threads), 32 * cuda.get_current_device().MULTIPROCESSOR_COUNT)
    best_s = min(event_seconds(lambda: copy[blocks, threads](src, dst), repeats))
    moved = 8 * n
    bandwidth = moved / best_s / 1e9
    info = describe_gpu()
    theoretical = info.theoretical_bandwidth_gbs if info else None
    return DeviceBandwidth(moved, bandwidth, bandwidth / theoretical if theoretical else None)


def event_seconds(run, repeats: int = 20) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``run``, timed by CUDA events, after one warm-up call
    (it compiles). One call at a time, as decode issues them: each time includes the launch latency."""
    run()
    cuda.synchronize()
    start, end = cuda.event(), cuda.event()
    times = []
    for _ in range(repeats):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in milliseconds
    return times


# FP32 lanes (CUDA cores) per SM by compute capability, from NVIDIA's CUDA C++ Programming Guide
FP32_LANES_PER_SM = {(7, 0): 64, (7, 5): 64, (8, 0): 64, (8, 6): 128, (8, 7): 128, (8, 9): 128,
                     (9, 0): 128, (10, 0): 128, (12, 0): 128}


def fp32_peak_flops() -> float | None:
    """SMs x FP32 lanes per SM x 2 (a fused multiply-add) x clock; None without a GPU or for an
    architecture not in FP32_LANES_PER_SM."""
    if not gpu_available():
        return None
    device = cuda.get_current_device()
    lanes = FP32_LANES_PER_SM.get(tuple(device.compute_capability))
    if lanes is None:
        return None
    return device.MULTIPROCESSOR_COUNT * lanes * 2 * device.CLOCK_RATE * 1e3


@functools.cache
def _kernels():
    """Compiled on first use only: defining CUDA kernels needs no GPU, launching them does."""

    @cuda.jit
    def empty():
        pass

    @cuda.jit
    def copy(src, dst):
        # Grid-stride loop: a fixed grid walks the whole array, consecutive threads on
        # consecutive elements so every warp's loads coalesce into full memory transactions.
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        for i in range(start, src.size, stride):
            dst[i] = src[i]

    return empty, copy


def _device_attribute(device, name: str) -> int | None:
    """A CUDA device attribute, or None where this driver does not know it."""
    try:
        return int(getattr(device, name))
    except Exception:   # attributes retired in newer CUDA versions raise from the driver binding
        return None

