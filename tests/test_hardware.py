"""Layer 1: the machine description, the microbenchmarks, the roofline arithmetic.

Microbenchmarks are checked for sane output (positive, finite, the right shape) on tiny sweeps,
never against timing thresholds: the speed of a shared machine is not a test result. The roofline
and decode arithmetic is checked exactly, on hand-computed inputs and the chapter's H100 example.
"""
import json
import math
import platform

import numba
import numpy as np
import pytest

from minillm.hardware import devices, gpu, microbench, roofline
from minillm.hardware.machine import compile_target, describe_machine, package_versions
from minillm.hardware.microbench import KIB, MIB
from minillm.kernels.cpu.quant_llvm import hot_loop_asm

# The H100 example of chapter 01: 70B parameters at 1 byte/weight, 3.35 TB/s HBM, 989.4 TFLOP/s dense BF16.
N_70B, H100_BANDWIDTH, H100_PEAK = 70e9, 3.35e12, 989.4e12


# ----------------------------------------------------------------------------------------------
# Exercise 1: the roofline

@pytest.mark.ch01_roofline
def test_attainable_flops_is_min_of_peak_and_intensity_times_bandwidth(impl):
    rf = impl("ch01_hardware")
    assert rf.attainable_flops(0.5, 1e12, 1e11) == pytest.approx(5e10)    # memory-bound
    assert rf.attainable_flops(100.0, 1e12, 1e11) == pytest.approx(1e12)  # compute-bound
    assert rf.attainable_flops(10.0, 1e12, 1e11) == pytest.approx(1e12)   # exactly at the ridge
    assert rf.attainable_flops(0.0, 1e12, 1e11) == 0.0


@pytest.mark.ch01_roofline
def test_attainable_flops_draws_a_whole_roof_from_an_array(impl):
    rf = impl("ch01_hardware")
    intensity = np.array([0.25, 1.0, 4.0, 16.0, 64.0])
    got = np.asarray(rf.attainable_flops(intensity, 2e12, 1e11))
    np.testing.assert_allclose(got, [2.5e10, 1e11, 4e11, 1.6e12, 2e12])


@pytest.mark.ch01_roofline
def test_attainable_flops_refuses_bad_input(impl):
    rf = impl("ch01_hardware")
    with pytest.raises(ValueError):
        rf.attainable_flops(-1.0, 1e12, 1e11)
    with pytest.raises(ValueError):
        rf.attainable_flops(1.0, 0.0, 1e11)
    with pytest.raises(ValueError):
        rf.attainable_flops(1.0, 1e12, -5.0)


# ----------------------------------------------------------------------------------------------
# Exercise 2: the decode ceiling

@pytest.mark.ch01_decode_ceiling
def test_decode_ceiling_is_batch_times_bandwidth_over_weight_bytes(impl):
    rf = impl("ch01_hardware")
    assert rf.decode_ceiling_tokens_per_s(1e9, 2.0, 1e11) == pytest.approx(50.0)
    assert rf.decode_ceiling_tokens_per_s(1e9, 2.0, 1e11, batch=8) == pytest.approx(400.0)
    assert rf.decode_ceiling_tokens_per_s(1e9, 0.5, 1e11, 1) == pytest.approx(200.0)


@pytest.mark.ch01_decode_ceiling
def test_decode_ceiling_of_70b_on_an_h100(impl):
    rf = impl("ch01_hardware")
    assert rf.decode_ceiling_tokens_per_s(N_70B, 1.0, H100_BANDWIDTH) == pytest.approx(47.857, rel=1e-4)


@pytest.mark.ch01_decode_ceiling
@pytest.mark.parametrize("bad", ["n_params", "bytes_per_weight", "bandwidth_bytes_per_s", "batch"])
def test_decode_ceiling_refuses_non_positive_arguments(impl, bad):
    rf = impl("ch01_hardware")
    args = {"n_params": 1e9, "bytes_per_weight": 1.0, "bandwidth_bytes_per_s": 1e11, "batch": 1}
    args[bad] = 0
    with pytest.raises(ValueError, match=bad):
        rf.decode_ceiling_tokens_per_s(**args)


# ----------------------------------------------------------------------------------------------
# The four numbers and the Roofline object (package only)

def test_seventy_billion_on_an_h100_is_148x_memory_bound():
    four = roofline.four_numbers(N_70B, 1.0, H100_PEAK, H100_BANDWIDTH)
    assert four.weight_bytes == 70e9
    assert four.memory_s_per_step * 1e3 == pytest.approx(20.9, abs=0.05)      # 70e9 / 3.35e12 s
    assert four.compute_s_per_step * 1e3 == pytest.approx(0.1415, abs=1e-4)   # 2 * 70e9 / 989.4e12 s = 0.14150
    assert four.memory_over_compute == pytest.approx(148, abs=0.5)
    assert four.decode_ceiling_tokens_per_s == pytest.approx(1 / four.memory_s_per_step)
    assert (devices.H100_SXM.peak_flops, devices.H100_SXM.bandwidth_bytes_per_s) == (H100_PEAK, H100_BANDWIDTH)


def test_llama2_70b_on_one_a100_at_the_bandwidth_limit():
    # The figure quoted in the course's sources: 1.5 TB/s over 70B x 2 bytes (FP16) = 10.7 tokens/s.
    assert roofline.decode_ceiling_tokens_per_s(70e9, 2.0, 1.5e12) == pytest.approx(10.71, abs=0.01)
    # The A100 80GB SXM data sheet (2,039 GB/s) and Llama-2-70B's 68,976,648,192 parameters give more:
    a100 = devices.A100_SXM_80GB
    assert roofline.decode_ceiling_tokens_per_s(68_976_648_192, 2.0, a100.bandwidth_bytes_per_s) == pytest.approx(
        2.039e12 / 137_953_296_384)


def test_data_sheet_devices_and_their_ridge_points():
    h100, a100 = devices.H100_SXM, devices.A100_SXM_80GB
    assert h100.ridge_point() == pytest.approx(989.4e12 / 3.35e12) and round(h100.ridge_point()) == 295
    assert a100.ridge_point() == pytest.approx(312e12 / 2.039e12)
    assert (a100.peak("fp32"), a100.peak("int8"), h100.peak("fp16")) == (19.5e12, 624e12, 989.4e12)
    assert h100.ridge_point("fp32") == pytest.approx(66.9e12 / 3.35e12)
    with pytest.raises(ValueError, match="fp8"):
        h100.peak("fp8")
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s"):
        devices.DeviceSpec("broken", 80e9, 0.0, 1.0, 1.0, 1.0, 1.0)
    rf = roofline.Roofline.of_device(h100, "int8")
    assert rf.peak_flops == 1978.9e12 and rf.bandwidths == {"HBM": 3.35e12}


def test_decode_step_is_the_slower_of_bytes_and_flops():
    # 1 GB of weights, 2 GFLOP per token, 10 TFLOP/s, 100 GB/s: 10 ms of reading, 0.2 ms of math per token.
    one = roofline.decode_step(1e9, 2e9, 1e13, 1e11)
    assert (one.bytes_moved, one.flops, one.seconds, one.bound) == (1e9, 2e9, pytest.approx(0.01), "memory")
    assert one.tokens_per_s == pytest.approx(100) and one.intensity == 2.0
    # Each sequence reads 50 MB of KV and does 0.1 GFLOP of attention: batch 64 is still memory-bound ...
    many = roofline.decode_step(1e9, 2e9, 1e13, 1e11, batch=64, state_bytes_per_seq=5e7, state_flops_per_seq=1e8)
    assert many.bytes_moved == 1e9 + 64 * 5e7 and many.flops == 64 * 2.1e9
    assert many.seconds == pytest.approx(4.2e9 / 1e11) and many.bound == "memory"
    assert many.achieved_flops == pytest.approx(many.flops / many.seconds)
    # ... and with a 20x slower processor the arithmetic takes over.
    slow = roofline.decode_step(1e9, 2e9, 5e11, 1e11, batch=64)
    assert slow.bound == "compute" and slow.seconds == pytest.approx(64 * 2e9 / 5e11)
    with pytest.raises(ValueError, match="state_bytes_per_seq"):
        roofline.decode_step(1e9, 2e9, 1e13, 1e11, state_bytes_per_seq=-1.0)


def test_batching_shares_the_weight_reads():
    one = roofline.four_numbers(1e9, 2.0, 1e13, 1e12, batch=1)
    many = roofline.four_numbers(1e9, 2.0, 1e13, 1e12, batch=16)
    assert many.memory_s_per_step == one.memory_s_per_step            # weights read once either way
    assert many.compute_s_per_step == pytest.approx(16 * one.compute_s_per_step)
    assert many.decode_ceiling_tokens_per_s == pytest.approx(16 * one.decode_ceiling_tokens_per_s)
    assert roofline.decode_intensity_flop_per_byte(2.0, batch=16) == 16.0  # 2 * 16 FLOP / 2 bytes


def test_roofline_object_ridge_points_and_levels():
    rf = roofline.Roofline(peak_flops=1e12, bandwidths={"L1": 1e12, "DRAM": 1e11})
    assert rf.main_memory == "DRAM"
    assert rf.ridge_point() == 10.0 and rf.ridge_point("L1") == 1.0
    assert rf.attainable(2.0) == pytest.approx(2e11)
    assert rf.attainable(2.0, "L1") == pytest.approx(1e12)
    with pytest.raises(ValueError, match="L3"):
        rf.attainable(2.0, "L3")
    measured = roofline.Roofline.measured(1000.0, {"DRAM": 20.0})
    assert measured.peak_flops == 1e12 and measured.bandwidths == {"DRAM": 2e10}


def test_roofline_plot_draws_one_roof_per_level_and_the_points():
    import matplotlib

    matplotlib.use("Agg")
    rf = roofline.Roofline(peak_flops=1e12, bandwidths={"L1": 1e12, "L2": 5e11, "DRAM": 1e11})
    ax = rf.plot(points=[roofline.RooflinePoint("decode", 4.0, 3e11)])
    labels = [line.get_label() for line in ax.get_lines()]
    assert sum(label.startswith(("L1", "L2", "DRAM")) for label in labels) == 3
    assert any(text.get_text() == "decode" for text in ax.texts)
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"


def test_plot_rooflines_puts_two_machines_and_their_points_on_one_axes():
    import matplotlib

    matplotlib.use("Agg")
    cpu = roofline.Roofline(peak_flops=1e11, bandwidths={"DRAM": 1e10})
    gpu_roof = roofline.Roofline.of_device(devices.H100_SXM)
    ax = roofline.plot_rooflines({"cpu": (cpu, [roofline.RooflinePoint("b1", 2.0, 2e10)]),
                                  "h100": (gpu_roof, [roofline.RooflinePoint("b64", 128.0, 4e14)])})
    labels = [line.get_label() for line in ax.get_lines()]
    assert any(label.startswith("cpu: ridge 10.0") for label in labels)
    assert any(label.startswith("h100: ridge 295.3") for label in labels)
    assert {text.get_text() for text in ax.texts} == {"b1", "b64"}


# ----------------------------------------------------------------------------------------------
# The machine

def test_describe_machine_is_sane():
    m = describe_machine()
    assert m.cpu_model and m.architecture and m.os
    assert 1 <= m.cores <= m.logical_cpus and 1 <= m.usable_cpus <= m.logical_cpus
    assert m.memory_bytes is None or m.memory_bytes > 256 * MIB
    assert m.simd_width_bits in (128, 256, 512)
    for cache in m.caches:
        assert cache.level in (1, 2, 3, 4) and cache.size_bytes > 0 and cache.shared_by_cpus >= 1
    levels = [c.level for c in m.data_caches()]
    assert levels == sorted(levels)
    json.dumps(package_versions())   # a JSON-ready stamp for benchmark results


def test_package_versions_come_from_metadata():
    versions = package_versions()
    assert versions["numpy"] == np.__version__
    assert {"python", "numba", "llvmlite"} <= versions.keys()


@pytest.mark.parametrize("no_gpu", ["no device", "simulator"])
def test_without_a_gpu_everything_returns_none_and_says_why(monkeypatch, no_gpu):
    # Whatever this machine has, pretend it has no GPU (or runs the CUDA simulator).
    if no_gpu == "no device":
        monkeypatch.setattr(gpu.cuda, "is_available", lambda: False)
    else:
        monkeypatch.setattr(gpu.config, "ENABLE_CUDASIM", True)
    assert not gpu.gpu_available()
    assert ("simulator" if no_gpu == "simulator" else "no CUDA GPU") in gpu.gpu_status()
    assert gpu.describe_gpu() is None
    assert gpu.launch_overhead() is None
    assert gpu.device_bandwidth() is None


# ----------------------------------------------------------------------------------------------
# Microbenchmarks: tiny sweeps, checked for sense, not speed

@pytest.mark.parametrize("n", [1, 2, 3, 10, 1000])
def test_single_cycle_permutation_is_one_cycle_through_every_element(n):
    perm = microbench.single_cycle_permutation(n, np.random.default_rng(n))
    assert sorted(perm.tolist()) == list(range(n))   # a permutation
    seen, i = set(), 0
    for _ in range(n):                               # follow it: back at 0 after exactly n hops
        seen.add(i)
        i = perm[i]
    assert i == 0 and len(seen) == n


def test_single_cycle_permutation_is_random():
    draws = {tuple(microbench.single_cycle_permutation(5, np.random.default_rng(s))) for s in range(50)}
    assert len(draws) > 10   # (5-1)! = 24 single cycles exist


def _finite_positive(x):
    return math.isfinite(x) and x > 0


@pytest.mark.parametrize("threads", [1, None])   # the plain loop, and the parallel one on every core
@pytest.mark.parametrize("kernel", microbench.BANDWIDTH_KERNELS)
def test_bandwidth_sweep_returns_positive_figures(kernel, threads):
    sizes = [16 * KIB, 256 * KIB]
    points = microbench.bandwidth_sweep(kernel, sizes, threads=threads, repeats=1, min_bytes=1 * MIB)
    assert [p.kernel for p in points] == [kernel, kernel]
    assert all(p.threads == (threads or numba.get_num_threads()) for p in points)
    assert all(_finite_positive(p.bandwidth_gbs) for p in points)
    assert all(0 < p.working_set_bytes <= size for p, size in zip(points, sizes))


def test_latency_sweep_returns_positive_figures():
    points = microbench.latency_sweep([16 * KIB, 64 * KIB], hops=1 << 12, repeats=1)
    assert [p.working_set_bytes for p in points] == [16 * KIB, 64 * KIB]
    assert all(_finite_positive(p.latency_ns) for p in points)


def test_peak_flops_and_call_overheads_are_positive():
    peaks = [microbench.gemm_flops(64, repeats=1), microbench.fma_flops(1 << 10, threads=1, repeats=1),
             microbench.fma_flops(1 << 10, repeats=1)]
    for peak in peaks:
        assert _finite_positive(peak.gflops)
    overheads = microbench.call_overheads(calls=1000, repeats=1)
    assert len(overheads) >= 3
    assert all(math.isfinite(o.latency_ns) and o.latency_ns >= 0 for o in overheads)


def test_per_level_puts_each_working_set_in_the_level_it_fits():
    caps = {"L1": 32 * KIB, "L2": 1 * MIB, "L3": 32 * MIB}
    points = [microbench.LatencyPoint(size, ns, 1) for size, ns in [
        (16 * KIB, 1.0),          # L1: fits in half of L1
        (32 * KIB, 9.0),          # transition: neither
        (128 * KIB, 4.0), (512 * KIB, 6.0),  # L2: over 2 x L1, at most half of L2
        (8 * MIB, 20.0),          # L3
        (64 * MIB, 99.0),         # transition: under 4 x L3
        (256 * MIB, 100.0),       # DRAM
    ]]
    got = microbench.per_level(points, caps, "latency_ns", reduce=max)
    assert got == {"L1": 1.0, "L2": 6.0, "L3": 20.0, "DRAM": 100.0}


def test_level_capacities_scale_private_caches_with_threads():
    m = describe_machine()
    one, two = microbench.level_capacities(m, 1), microbench.level_capacities(m, 2)
    for cache in m.data_caches():   # two threads use two private caches, but one cache shared by both
        instances = 2 if cache.shared_by_cpus == 1 else 1
        assert two[f"L{cache.level}"] == instances * one[f"L{cache.level}"]


def test_sweep_sizes():
    assert microbench.sweep_sizes(16 * KIB, 1 * MIB, 4) == [16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB]
    with pytest.raises(ValueError):
        microbench.sweep_sizes(0, 1 * MIB)


@pytest.mark.parametrize("cpu, features, bits, vnni", [
    ("haswell", "", 256, False),                       # the named CPU's own features: AVX2
    ("znver3", "", 256, False),
    ("skylake-avx512", "", 512, False),
    ("sapphirerapids", "", 512, True),
    ("haswell", "+avx512f,+avx512bw", 512, False),     # "+f" on top of the named CPU
    ("sapphirerapids", "-avx512f", 256, True),
])
def test_compile_target_combines_the_cpu_name_and_features_as_numba_does(monkeypatch, cpu, features, bits, vnni):
    from numba.core import config

    if describe_machine().architecture not in ("x86_64", "AMD64"):
        pytest.skip("x86 CPU names")
    monkeypatch.setattr(config, "CPU_NAME", cpu)
    monkeypatch.setattr(config, "CPU_FEATURES", features)
    target = compile_target()
    assert (target.cpu_name, target.vector_bits, target.vnni) == (cpu, bits, vnni)


def test_a_cpu_name_alone_keeps_the_host_features(monkeypatch):
    """NUMBA_CPU_NAME without NUMBA_CPU_FEATURES: Numba passes the host's feature list to LLVM, so
    the code keeps the host's vector width (what the generated assembly shows)."""
    from numba.core import config

    monkeypatch.setattr(config, "CPU_NAME", None)
    monkeypatch.setattr(config, "CPU_FEATURES", None)
    host = compile_target()
    monkeypatch.setattr(config, "CPU_NAME", "haswell")
    named = compile_target()
    assert named.overridden and (named.vector_bits, named.vnni) == (host.vector_bits, host.vnni)


def test_best_time_keeps_timing_until_its_budget_so_that_disturbed_calls_do_not_set_the_figure():
    # A stand-in for a multi-threaded call on a busy machine: the first 12 calls are held up (a
    # preempted thread at the barrier), later ones run undisturbed. A fixed 10 repeats see only
    # the held-up calls (chapter 02's L3 read at 1.4 GB/s, below DRAM's 40); a budget reaches the
    # undisturbed ones.
    import time
    calls = []

    def run():
        calls.append(1)
        if len(calls) <= 12:
            time.sleep(0.005)

    assert microbench.best_time(run, repeats=10) >= 0.005
    calls.clear()
    assert microbench.best_time(run, repeats=10, budget_s=0.2) < 0.001


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="reads x86 assembly")
def test_fma_peak_runs_the_targets_widest_vectors():
    # LLVM vectorised the earlier plain loop with 256-bit FMAs on an Intel AVX-512 host: half the peak
    target = compile_target()
    register = {512: "zmm", 256: "ymm"}.get(target.vector_bits, "xmm")
    kernel = numba.njit(lambda iters, seed: microbench._fma_vectors(iters, seed))
    kernel(4, 0)
    hot_loop = hot_loop_asm(next(iter(kernel.inspect_asm().values())), "vfmadd")
    fmas = [line for line in hot_loop if line.startswith("vfmadd")]
    assert fmas and len(fmas) % microbench.fma_chains(target.vector_bits) == 0  # LLVM may unroll the loop
    assert all(f"%{register}" in line for line in fmas), fmas


def test_fma_peak_computes_what_it_counts():
    # every chain of every lane follows x = x * a + b from (seed + c) / 1000: the sum of all of them
    iters, seed = 50, 3
    target = compile_target()
    lanes, chains = target.vector_bits // 32, microbench.fma_chains(target.vector_bits)
    x = (np.float32(seed) + np.arange(chains, dtype=np.float32)) * np.float32(1e-3)  # (chains,)
    for _ in range(iters):
        x = (x.astype(np.float64) * np.float32(0.999999) + np.float32(1e-7)).astype(np.float32)  # one rounding
    expected = lanes * x.astype(np.float64).sum()
    got = numba.njit(lambda n, s: microbench._fma_vectors(n, s))(iters, seed)
    assert got == pytest.approx(expected, rel=1e-5)
    assert microbench.fma_flop_per_call(iters) == 2 * chains * lanes * iters


@pytest.mark.skipif(microbench.int8_dot_instruction() is None, reason="no multiply-add of bytes on this target")
def test_int8_peak_runs_the_targets_multiply_add_of_bytes():
    target = compile_target()
    instruction = microbench.int8_dot_instruction()
    register = {512: "zmm", 256: "ymm"}[target.vector_bits]
    kernel = numba.njit(lambda iters, seed: microbench._int8_dot_vectors(iters, seed))
    kernel(4, 0)
    hot_loop = hot_loop_asm(next(iter(kernel.inspect_asm().values())), instruction)
    dots = [line for line in hot_loop if line.startswith(instruction)]
    assert dots and len(dots) % microbench.fma_chains(target.vector_bits) == 0  # LLVM may unroll the loop
    assert all(f"%{register}" in line for line in dots), dots


@pytest.mark.skipif(microbench.int8_dot_instruction() is None, reason="no multiply-add of bytes on this target")
def test_int8_peak_computes_what_it_counts():
    """Every chain modelled in NumPy: vpdpbusd adds 4 products of bytes into each int32 lane
    (wrapping); vpmaddubsw sums 2 products into each int16 lane, saturated, and its result's bytes
    are the next step's signed operand. The call returns every lane of every chain, summed."""
    iters, seed = 40, 7
    target = compile_target()
    n_bytes, chains = target.vector_bits // 8, microbench.fma_chains(target.vector_bits)
    vnni = microbench.int8_dot_instruction() == "vpdpbusd"
    total = np.zeros(n_bytes // (4 if vnni else 2), dtype=np.int32 if vnni else np.int16)
    for c in range(chains):
        u = microbench.int8_dot_operand(c)
        acc = np.full(n_bytes, (seed + c) % 256, dtype=np.uint8).view(np.int32 if vnni else np.int16)  # (lanes,)
        for _ in range(iters):
            if vnni:
                acc = acc + np.int32(4 * u * microbench.INT8_DOT_SIGNED)  # wraps, as the hardware does
            else:
                s = acc.view(np.int8).astype(np.int64).reshape(-1, 2)   # (lanes, 2) signed bytes
                acc = np.clip(u * s.sum(axis=1), -32768, 32767).astype(np.int16)
        total = total + acc
    got = numba.njit(lambda n, s: microbench._int8_dot_vectors(n, s))(iters, seed)
    assert got == int(total.astype(np.int64).sum())
    assert microbench.int8_macs_per_call(iters) == chains * n_bytes * iters
    assert _finite_positive(microbench.int8_dot_ops(1 << 10, threads=1, repeats=1).gops)
