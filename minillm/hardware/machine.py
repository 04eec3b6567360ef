"""What machine is this? CPU model, cores, caches, SIMD extensions, memory, package versions.

Everything an inference engine's speed depends on, read from the operating system (Linux sysfs and
/proc, macOS sysctl) and from LLVM, which is the compiler Numba uses: the SIMD features listed are
the ones Numba's generated code can actually use on this CPU.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import llvmlite.binding as llvm

SYSFS_CPU = Path("/sys/devices/system/cpu")

# SIMD extensions that matter for the kernels of this course, by LLVM's names (x86, then Arm).
SIMD_FEATURES = (
    "sse4.2", "avx", "avx2", "fma", "f16c",
    "avx512f", "avx512bw", "avx512vl", "avx512vnni", "avx512bf16", "avx512fp16",
    "amx-tile", "amx-bf16", "amx-int8",
    "neon", "fullfp16", "dotprod", "i8mm", "bf16", "sve", "sve2",
)

# Packages whose versions stamp every measurement (distribution name -> label in reports).
VERSIONED_PACKAGES = {
    "numpy": "numpy", "numba": "numba", "llvmlite": "llvmlite", "numba-cuda": "numba_cuda",
    "torch": "torch", "transformers": "transformers", "llama-cpp-python": "llama_cpp",
}


# ----------------------------------------------------------------------------------------------
# The description

@dataclass(frozen=True)
class CacheLevel:
    """One level of the cache hierarchy, as seen by one core (``size_bytes`` is one instance)."""

    level: int             # 1, 2, 3
    kind: str              # "Data", "Instruction" or "Unified"
    size_bytes: int        # capacity of one instance
    shared_by_cpus: int    # logical CPUs sharing one instance (1 or 2: private; all: shared L3)


@dataclass(frozen=True)
class Machine:
    cpu_model: str               # "AMD EPYC 9R14", "Apple M2", ...
    architecture: str            # "x86_64", "arm64", ...
    llvm_cpu: str                # the CPU LLVM (hence Numba) compiles for: "znver4", "apple-m1", ...
    cores: int                   # physical cores
    logical_cpus: int            # hardware threads (cores x SMT)
    usable_cpus: int             # CPUs this process may run on (containers and taskset restrict it)
    caches: tuple[CacheLevel, ...]
    simd: tuple[str, ...]        # SIMD_FEATURES this CPU has
    simd_width_bits: int         # widest vector register: 128 (SSE, NEON), 256 (AVX2), 512 (AVX-512)
    memory_bytes: int | None     # physical memory; None where the OS does not say
    os: str                      # "Linux 6.8.0", "Darwin 23.1.0", ...

    def cache_bytes(self, level: int) -> int | None:
        """Capacity of one instance of the data (or unified) cache at ``level``; None if unknown."""
        for cache in self.caches:
            if cache.level == level and cache.kind in ("Data", "Unified"):
                return cache.size_bytes
        return None

    def data_caches(self) -> tuple[CacheLevel, ...]:
        """The caches data goes through (instruction caches left out), L1 first."""
        return tuple(sorted((c for c in self.caches if c.kind in ("Data", "Unified")), key=lambda c: c.level))


def describe_machine() -> Machine:
    """Describe the machine this process runs on."""
    simd = _simd_features()
    return Machine(
        cpu_model=_cpu_model(),
        architecture=platform.machine(),
        llvm_cpu=llvm.get_host_cpu_name(),
        cores=_physical_cores(),
        logical_cpus=os.cpu_count() or 1,
        usable_cpus=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1),
        caches=_caches(),
        simd=simd,
        simd_width_bits=512 if "avx512f" in simd else 256 if "avx" in simd else 128,
        memory_bytes=_memory_bytes(),
        os=f"{platform.system()} {platform.release()}",
    )


# LLVM CPU names whose widest vectors are 512 bits (AVX-512). Numba's code for any other x86 name
# uses 256-bit AVX2 at most (128-bit SSE for CPUs older than Haswell, which this course ignores).
AVX512_CPUS = ("skylake-avx512", "cascadelake", "cooperlake", "cannonlake", "icelake-client",
               "icelake-server", "tigerlake", "rocketlake", "sapphirerapids", "emeraldrapids",
               "graniterapids", "graniterapids-d", "diamondrapids", "znver4", "znver5", "x86-64-v4")


@dataclass(frozen=True)
class CompileTarget:
    """The CPU Numba generates code for: the host, unless ``NUMBA_CPU_NAME`` names another one.

    Numba hands LLVM a CPU name and a feature list. ``NUMBA_CPU_NAME`` alone changes only the name:
    the feature list is still the host's, so on an AVX-512 host ``NUMBA_CPU_NAME=haswell`` still
    emits 512-bit code (checked in the assembly). ``NUMBA_CPU_FEATURES=""`` as well takes the named
    CPU's own features: ``NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=""`` compiles real AVX2 code,
    so both code paths can be measured on one host; every benchmark result records which one ran.
    """
    cpu_name: str                # LLVM's name for the target CPU
    overridden: bool             # True when NUMBA_CPU_NAME chose it (not the host)
    vector_bits: int             # widest SIMD register the generated code may use: 128, 256, 512
    vnni: bool                   # int8 dot-product instructions (AVX512-VNNI or AVX-VNNI)

    @property
    def isa(self) -> str:
        """A short label for result files: "avx512", "avx2", "neon" or "sse"."""
        if platform.machine() in ("arm64", "aarch64"):
            return "neon"
        return {512: "avx512", 256: "avx2"}.get(self.vector_bits, "sse")


PRE_AVX2_CPUS = ("x86-64", "x86-64-v2", "nehalem", "westmere", "sandybridge", "ivybridge")


def _named_cpu_features(name: str) -> set[str]:
    """The SIMD features (LLVM's names) of an x86 CPU LLVM knows by name, as far as this course cares."""
    features = set() if name in PRE_AVX2_CPUS else {"avx2", "fma"}
    if name in AVX512_CPUS:
        features |= {"avx512f", "avx512bw"}
        if name not in ("skylake-avx512", "cannonlake", "x86-64-v4"):
            features.add("avx512vnni")
    return features


def compile_target() -> CompileTarget:
    """What Numba compiles for in this process: its CPU name and feature list, read from numba's
    config and combined as Numba does (see ``CompileTarget``)."""
    from numba.core import config

    host = llvm.get_host_cpu_name()
    name = config.CPU_NAME or host
    if config.CPU_FEATURES is None:      # Numba passes the host's feature list, whatever the name
        features = {n for n, on in _host_features().items() if on}
    else:                                # the named CPU's features, then "+f,-g" on top
        features = _named_cpu_features(name)
        for item in filter(None, (f.strip() for f in config.CPU_FEATURES.split(","))):
            (features.add if item[0] == "+" else features.discard)(item[1:])
    if platform.machine() in ("arm64", "aarch64"):
        bits = 128
    else:
        bits = 512 if "avx512f" in features else 256 if "avx2" in features else 128
    vnni = "avx512vnni" in features or "avxvnni" in features
    return CompileTarget(cpu_name=name, overridden=name != host, vector_bits=bits, vnni=vnni)


def package_versions() -> dict[str, str]:
    """Versions of Python and of the numerical packages that are installed (absent ones left out).

    Read from the installed distributions' metadata: nothing is imported, so asking costs nothing
    even for torch.
    """
    versions = {"python": platform.python_version(), "minillm": _distribution_version("minillm")}
    for distribution, label in VERSIONED_PACKAGES.items():
        versions[label] = _distribution_version(distribution)
    return {label: version for label, version in versions.items() if version is not None}


# ----------------------------------------------------------------------------------------------
# Reading the operating system

def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _sysctl(name: str) -> str | None:
    """macOS ``sysctl -n name``; None elsewhere or when the key does not exist."""
    if sys.platform != "darwin":
        return None
    result = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True)
    if result.returncode != 0:
        return None
    return result.stdout.strip() or None


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                return value.strip()
    return _sysctl("machdep.cpu.brand_string") or platform.processor() or platform.machine()


def _physical_cores() -> int:
    """Distinct (package, core) pairs in sysfs; hw.physicalcpu on macOS; else the logical count."""
    cores = set()
    for topology in SYSFS_CPU.glob("cpu[0-9]*/topology"):
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:
            continue
    if cores:
        return len(cores)
    return int(_sysctl("hw.physicalcpu") or os.cpu_count() or 1)


def _parse_size(text: str) -> int:
    """sysfs cache sizes: "32K", "1024K", "32768K", sometimes "8M"."""
    units = {"K": 1024, "M": 1024**2, "G": 1024**3}
    text = text.strip()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _cpu_list_length(text: str) -> int:
    """Number of CPUs in a sysfs list such as "0-3,8-11"."""
    count = 0
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return count


def _caches() -> tuple[CacheLevel, ...]:
    caches = []
    for index in sorted((SYSFS_CPU / "cpu0" / "cache").glob("index[0-9]*")):
        try:
            caches.append(CacheLevel(
                level=int((index / "level").read_text()),
                kind=(index / "type").read_text().strip(),
                size_bytes=_parse_size((index / "size").read_text()),
                shared_by_cpus=_cpu_list_length((index / "shared_cpu_list").read_text()),
            ))
        except (OSError, ValueError):
            continue
    if caches:
        return tuple(caches)
    # macOS reports sizes only; the L2 of Apple silicon is shared by a cluster of cores.
    sizes = [("hw.l1dcachesize", 1, "Data"), ("hw.l2cachesize", 2, "Unified"), ("hw.l3cachesize", 3, "Unified")]
    return tuple(CacheLevel(level, kind, int(size), 1) for key, level, kind in sizes if (size := _sysctl(key)))


def _host_features() -> dict[str, bool]:
    try:
        return dict(llvm.get_host_cpu_features())
    except RuntimeError:   # LLVM cannot query some hosts; report no extension rather than guess
        return {}


def _simd_features() -> tuple[str, ...]:
    host = {name for name, enabled in _host_features().items() if enabled}
    if platform.machine() in ("arm64", "aarch64"):
        host.add("neon")   # mandatory on 64-bit Arm; LLVM does not always list it
    return tuple(feature for feature in SIMD_FEATURES if feature in host)


def _memory_bytes() -> int | None:
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None
