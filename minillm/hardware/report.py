"""`minillm hw`: describe this machine and measure it, as a table or as JSON.

A short version of chapter 01's measurements (well under a minute on two cores): bandwidth per
memory level, latency per cache level, peak FP32 FLOP/s, per-call overheads, the GPU if any, and
the roofline they imply. Progress goes to stderr, so `minillm hw --json > hw.json` stays clean.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass

import numba
from tqdm import tqdm

from minillm.hardware import gpu
from minillm.hardware.machine import Machine, describe_machine, package_versions
from minillm.hardware.microbench import (BANDWIDTH_KERNELS, GIB, KIB, MIB, BandwidthPoint, CallOverhead,
                                         LatencyPoint, PeakFlops, bandwidth_by_level, call_overheads,
                                         fma_flops, gemm_flops, latency_by_level, measure_bandwidth,
                                         measure_latency, sweep_sizes)
from minillm.hardware.roofline import Roofline

# The quick sweep: working sets x4 apart for bandwidth, x2 apart for the latency staircase.
BANDWIDTH_SIZES = sweep_sizes(16 * KIB, GIB, factor=4)
LATENCY_SIZES = sweep_sizes(16 * KIB, 256 * MIB, factor=2)
# (kernel, threads): one core reading (the figure a busy machine disturbs least), then every core.
BANDWIDTH_SWEEPS = [("read", 1)] + [(kernel, numba.get_num_threads()) for kernel in BANDWIDTH_KERNELS]


@dataclass
class HardwareReport:
    machine: Machine
    versions: dict[str, str]
    bandwidth: dict[str, list[BandwidthPoint]]           # "read x1", "triad x2", ... -> sweep
    bandwidth_by_level_gbs: dict[str, dict[str, float]]  # same keys -> level -> GB/s
    latency: list[LatencyPoint]
    latency_by_level_ns: dict[str, float]
    peak_flops: list[PeakFlops]
    call_overheads: list[CallOverhead]
    gpu_status: str
    gpu: gpu.GpuInfo | None
    gpu_launch: gpu.LaunchOverhead | None
    gpu_bandwidth: gpu.DeviceBandwidth | None

    def roofline(self) -> Roofline:
        """Peak: the best FLOP/s measured; each level's roof: the best bandwidth any sweep reached."""
        levels = {}
        for by_level in self.bandwidth_by_level_gbs.values():
            for level, gbs in by_level.items():
                levels[level] = max(gbs, levels.get(level, 0.0))
        return Roofline.measured(max(p.gflops for p in self.peak_flops), levels, self.machine.cpu_model)


def measure(progress: bool = True) -> HardwareReport:
    """Run every measurement once (the quick sweep), showing a progress bar on stderr."""
    machine = describe_machine()
    steps = ([("bandwidth", sweep, size) for sweep in BANDWIDTH_SWEEPS for size in BANDWIDTH_SIZES]
             + [("latency", None, size) for size in LATENCY_SIZES]
             + [("flops", None, None), ("calls", None, None), ("gpu", None, None)])
    bandwidth = {f"{kernel} x{threads}": [] for kernel, threads in BANDWIDTH_SWEEPS}
    latency, flops, overheads = [], [], []
    gpu_info = gpu_launch = gpu_bandwidth = None
    for what, sweep, size in tqdm(steps, desc="measuring", file=sys.stderr, disable=not progress, leave=False):
        if what == "bandwidth":
            kernel, threads = sweep
            bandwidth[f"{kernel} x{threads}"].append(measure_bandwidth(kernel, size, threads))
        elif what == "latency":
            latency.append(measure_latency(size))
        elif what == "flops":
            flops = [gemm_flops(), fma_flops(threads=1), fma_flops()]
        elif what == "calls":
            overheads = call_overheads(calls=50_000, repeats=3)
        else:
            gpu_info, gpu_launch, gpu_bandwidth = gpu.describe_gpu(), gpu.launch_overhead(), gpu.device_bandwidth()
    return HardwareReport(
        machine=machine,
        versions=package_versions(),
        bandwidth=bandwidth,
        bandwidth_by_level_gbs={k: bandwidth_by_level(points, machine) for k, points in bandwidth.items()},
        latency=latency,
        latency_by_level_ns=latency_by_level(latency, machine),
        peak_flops=flops,
        call_overheads=overheads,
        gpu_status=gpu.gpu_status(),
        gpu=gpu_info,
        gpu_launch=gpu_launch,
        gpu_bandwidth=gpu_bandwidth,
    )


def main(as_json: bool = False) -> int:
    report = measure()
    if as_json:
        payload = dataclasses.asdict(report)
        roofline = report.roofline()
        payload["roofline"] = {
            "peak_flops": roofline.peak_flops,
            "bandwidths_bytes_per_s": roofline.bandwidths,
            "ridge_points_flop_per_byte": {level: roofline.ridge_point(level) for level in roofline.bandwidths},
        }
        print(json.dumps(payload, indent=2))
    else:
        print(format_table(report))
    return 0


# ----------------------------------------------------------------------------------------------
# The table

def format_table(report: HardwareReport) -> str:
    m = report.machine
    caches = ", ".join(f"L{c.level}{'d' if c.kind == 'Data' else ''} {_size(c.size_bytes)}"
                       + (" per core" if c.shared_by_cpus == 1 else f" shared by {c.shared_by_cpus} CPUs")
                       for c in m.data_caches())
    memory = f"{m.memory_bytes / GIB:.1f} GiB" if m.memory_bytes else "unknown"
    lines = [
        "minillm hw - this machine, measured (best of repeats; other processes only make figures lower)",
        "",
        f"CPU        {m.cpu_model} (LLVM target {m.llvm_cpu}), {m.cores} cores, {m.logical_cpus} logical CPUs",
        f"SIMD       {m.simd_width_bits}-bit: {' '.join(m.simd) or 'none detected'}",
        f"caches     {caches or 'unknown'}",
        f"memory     {memory}",
        f"GPU        {_gpu_line(report)}",
        f"versions   {', '.join(f'{name} {version}' for name, version in report.versions.items())}",
        "",
    ]
    sweeps = list(report.bandwidth)
    lines.append("Bandwidth, GB/s (xN: N threads)      " + "".join(f"{sweep:>10}" for sweep in sweeps))
    for i, point in enumerate(report.bandwidth[sweeps[0]]):
        row = "".join(f"{report.bandwidth[sweep][i].bandwidth_gbs:10.1f}" for sweep in sweeps)
        lines.append(f"  working set {_size(point.working_set_bytes):>10}           {row}")
    for level in report.roofline().bandwidths:
        row = "".join(f"{report.bandwidth_by_level_gbs[sweep].get(level, float('nan')):10.1f}" for sweep in sweeps)
        lines.append(f"  {level + ' plateau':<35}{row}")
    lines += ["", "Latency, ns per dependent load (1 thread)"]
    for point in report.latency:
        lines.append(f"  working set {_size(point.working_set_bytes):>10}  {point.latency_ns:8.1f}")
    lines.append("  " + ", ".join(f"{level} {ns:.1f} ns" for level, ns in report.latency_by_level_ns.items()))
    lines += ["", "Peak FP32"]
    for peak in report.peak_flops:
        threads = f" ({peak.threads} thread{'s' if peak.threads > 1 else ''})" if peak.threads else ""
        lines.append(f"  {peak.method + threads:<36}{peak.gflops:9.1f} GFLOP/s")
    lines += ["", "Per-call overhead"]
    for overhead in report.call_overheads:
        lines.append(f"  {overhead.what:<36}{overhead.latency_ns:9.0f} ns")
    roofline = report.roofline()
    lines += ["", f"Roofline: peak {roofline.peak_flops / 1e9:.0f} GFLOP/s; ridge points (FLOP/byte) "
              + ", ".join(f"{level} {roofline.ridge_point(level):.1f}" for level in roofline.bandwidths)]
    lines.append(f"  a kernel below {roofline.ridge_point():.1f} FLOP/byte on data from {roofline.main_memory} is "
                 "memory-bound (batch-1 decode: 2 FLOP per weight, about 4 FLOP/byte at 4 bits per weight)")
    return "\n".join(lines)


def _gpu_line(report: HardwareReport) -> str:
    if report.gpu is None:
        return f"none ({report.gpu_status})"
    g = report.gpu
    line = (f"{g.name}, compute capability {g.compute_capability[0]}.{g.compute_capability[1]}, {g.sm_count} SMs, "
            f"warp {g.warp_size}, {_size(g.shared_memory_per_block_bytes)} shared memory per block, "
            f"{g.memory_bytes / GIB:.0f} GiB")
    if g.theoretical_bandwidth_gbs:
        line += f", {g.theoretical_bandwidth_gbs:,.0f} GB/s theoretical"
    if report.gpu_bandwidth:
        line += f", {report.gpu_bandwidth.bandwidth_gbs:,.0f} GB/s measured (copy)"
    if report.gpu_launch:
        line += (f"; kernel launch {report.gpu_launch.launch_us:.1f} us, "
                 f"launch + sync {report.gpu_launch.launch_and_sync_us:.1f} us")
    return line


def _size(n_bytes: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.0f} {unit}"
    return f"{n_bytes} B"
