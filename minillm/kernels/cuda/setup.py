"""Where the CUDA kernels run: a real GPU, or Numba's CUDA simulator - and the plumbing both share.

Numba compiles a `@cuda.jit` Python function to PTX, the GPU's assembly, the first time it is
launched. Without a GPU there is the CUDA *simulator* (`NUMBA_ENABLE_CUDASIM=1`, read once, when
`numba.cuda` is first imported): it runs the same kernel source as plain Python, one Python thread
per GPU thread, with the same `threadIdx`, `blockIdx`, shared memory and `syncthreads`. It is
correct and about a million times slower than a GPU, so under it we run tiny shapes only.

This module:
- `cuda_available()`: which of the two we have, or why we have neither;
- `to_gpu` / `to_host` / `empty_gpu`: the only doors across the bus - every host -> device and
  device -> host copy goes through `to_gpu` / `to_host`, which count them in `TRAFFIC` (copies and
  bytes, each way), and refuse clearly when there is no CUDA at all;
- `launch`: every kernel launch goes through it, counted in `TRAFFIC.launches`;
- launch geometry helpers shared by the kernels;
- the simulator's missing warp shuffles (see `_install_simulated_warp_shuffles`), and a shorter
  thread switch interval for it (`SIMULATOR_SWITCH_INTERVAL_S`).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import threading

import numpy as np
from numba import cuda
from numba.cuda.core import config as cuda_config

SIMULATOR = bool(cuda_config.ENABLE_CUDASIM)  # fixed when numba.cuda was first imported

# -----------------------------------------------------------------------------------------------
# The GPU's fixed numbers the kernels are written around

WARP = 32  # threads that execute one instruction together (SIMT); every NVIDIA GPU so far
FULL_MASK = 0xFFFFFFFF  # "all 32 lanes take part" for the *_sync warp intrinsics
MAX_THREADS = 256  # threads per block we ever launch: 8 warps, room for several blocks per SM


def cuda_available() -> tuple[bool, str]:
    """(True, what runs the kernels) or (False, why nothing can)."""
    if SIMULATOR:
        return True, ("Numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1): every GPU thread is a Python "
                      "thread - correct results, tiny shapes only, no meaningful timings")
    if cuda.is_available():
        name = cuda.get_current_device().name
        return True, f"GPU: {name.decode() if isinstance(name, bytes) else name}"
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False, ("CUDA is unavailable: no GPU found, and NUMBA_ENABLE_CUDASIM=1 was set after "
                       "numba had been imported - set it before any import (or in the shell)")
    return False, ("CUDA is unavailable: no GPU found and NUMBA_ENABLE_CUDASIM is not set "
                   "(run with NUMBA_ENABLE_CUDASIM=1, set before numba is imported, to use the simulator)")


def require_cuda() -> None:
    """Raise a RuntimeError that says why, unless a GPU or the simulator can run kernels."""
    available, reason = cuda_available()
    if not available:
        raise RuntimeError(reason)


# -----------------------------------------------------------------------------------------------
# Host <-> device, and launches: counted here, the one place every copy and launch passes through.

@dataclasses.dataclass
class BusTraffic:
    """Copies across the bus (each way: how many, how many bytes) and kernel launches, cumulative.

    A step's figures are a difference of two snapshots: ``TRAFFIC.snapshot()`` before, then
    ``TRAFFIC.since(before)``. One process-wide counter: the engine steps one forward at a time.
    """
    to_device_copies: int = 0
    to_device_bytes: int = 0
    to_host_copies: int = 0
    to_host_bytes: int = 0
    launches: int = 0

    def snapshot(self) -> BusTraffic:
        return dataclasses.replace(self)

    def since(self, before: BusTraffic) -> BusTraffic:
        return BusTraffic(**{f.name: getattr(self, f.name) - getattr(before, f.name) for f in dataclasses.fields(self)})


TRAFFIC = BusTraffic()


def to_gpu(array: np.ndarray, dtype=np.float32):
    """Copy a host array to the GPU (C-contiguous, in `dtype`): a PCIe transfer, ~10-25 GB/s."""
    require_cuda()
    host = np.ascontiguousarray(array, dtype=dtype)
    TRAFFIC.to_device_copies += 1
    TRAFFIC.to_device_bytes += host.nbytes
    return cuda.to_device(host)


def to_host(device_array, out: np.ndarray | None = None) -> np.ndarray:
    """Copy a device array back to host memory (into `out` if given) -> the host array."""
    TRAFFIC.to_host_copies += 1
    TRAFFIC.to_host_bytes += device_array.nbytes
    return device_array.copy_to_host() if out is None else device_array.copy_to_host(out)


def empty_gpu(shape, dtype=np.float32):
    """Uninitialised device memory for a kernel's output (like np.empty, on the GPU): no copy."""
    require_cuda()
    return cuda.device_array(shape, dtype=dtype)


def launch(configured_kernel, *args) -> None:
    """Run ``kernel[grid, block]`` on args, counting the launch (each costs ~5-10 us of CPU and driver)."""
    TRAFFIC.launches += 1
    configured_kernel(*args)


# -----------------------------------------------------------------------------------------------
# Launch geometry

def blocks_for(n: int, per_block: int) -> int:
    """Blocks needed to cover n items at per_block each (the last block is partly idle)."""
    return (n + per_block - 1) // per_block


def threads_for(n: int) -> int:
    """Threads for one block that cooperates on n items: a power of two, one warp to MAX_THREADS.

    A power of two so a shared-memory tree can halve it; no more threads than items (rounded up to
    a warp), since idle threads still occupy the SM's thread slots.
    """
    threads = WARP
    while threads < n and threads < MAX_THREADS:
        threads *= 2
    return threads


# -----------------------------------------------------------------------------------------------
# Warp shuffles for the simulator
#
# On a GPU, `cuda.shfl_down_sync(mask, v, delta)` hands each lane the register `v` of the lane
# `delta` above it - 32 registers exchanged in one instruction, no shared memory. The simulator
# (numba-cuda 0.30) does not implement the shuffles. We teach it the two our kernels use, with
# the semantics of the hardware: every lane of the warp must arrive (a warp-wide barrier, as the
# full mask promises), then reads the value its source lane deposited. Lanes whose source lies
# outside the warp (or past a partial last warp) keep their own value, as on the GPU. The mask is
# taken to be the whole warp: every kernel here passes FULL_MASK.
# The GPU never runs this code; kernels call cuda.shfl_*_sync either way.

SHUFFLE_TIMEOUT_S = 120.0  # a lane that never arrives is a bug (a diverged or exited lane): fail
_SHUFFLE_LOCK = threading.Lock()


def _exchange(value, source_lane_of):
    thread = threading.current_thread()
    block = thread._manager  # the simulator's per-block state
    lane, warp = thread.thread_id % WARP, thread.thread_id // WARP
    with _SHUFFLE_LOCK:
        state = block.__dict__.setdefault("_warp_shuffle", {"values": ({}, {}), "round": {}, "barriers": {}})
        if warp not in state["barriers"]:
            block_threads = int(np.prod(block._block_dim))
            lanes = min(WARP, block_threads - warp * WARP)
            state["barriers"][warp] = threading.Barrier(lanes, timeout=SHUFFLE_TIMEOUT_S)
    # Two value buffers, alternating by round: a lane cannot deposit round r + 2 (reusing this
    # round's buffer) before every lane has passed round r + 1's barrier, i.e. read round r.
    round_ = state["round"].get(thread.thread_id, 0)
    state["round"][thread.thread_id] = round_ + 1
    values = state["values"][round_ % 2]
    values[thread.thread_id] = value
    state["barriers"][warp].wait()  # every lane of the warp has deposited its value
    source = source_lane_of(lane)
    return values.get(warp * WARP + source, value) if 0 <= source < WARP else value


def _shfl_down_sync(self, mask, value, delta):
    return _exchange(value, lambda lane: lane + delta)


def _shfl_sync(self, mask, value, source_lane):
    return _exchange(value, lambda lane: source_lane % WARP)


def _install_simulated_warp_shuffles() -> None:
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    for name, function in (("shfl_down_sync", _shfl_down_sync), ("shfl_sync", _shfl_sync)):
        if not hasattr(FakeCUDAModule, name):
            setattr(FakeCUDAModule, name, function)


# The simulator runs a block by starting its threads and then polling them in a loop that never
# sleeps: it holds the GIL for a whole switch interval (5 ms by default) at a time, and every thread
# start, syncthreads and shuffle barrier waits for it to let go. A 0.5 ms interval: the tiny model's
# quantized matvec under the simulator ~1.5x faster (2-core AMD EPYC Zen 5 VM, alternating runs; 0.2 ms
# was no better). It changes only how often Python switches threads in a process that simulates.
SIMULATOR_SWITCH_INTERVAL_S = 0.0005

if SIMULATOR:
    _install_simulated_warp_shuffles()
    sys.setswitchinterval(SIMULATOR_SWITCH_INTERVAL_S)
