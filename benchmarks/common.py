"""The benchmark harness: one timer, contenders in processes of their own, interleaved repeats, medians,
and result files stamped with the machine, the instruction set each contender ran on and the versions.

Why a process per contender: thread pools spin after a call (Numba's OpenMP/TBB workers, PyTorch's
OpenMP, llama.cpp's ggml threadpool) and several of them in one process fight over the cores - a
0.5 s pause does not undo it: transformers' prefill read 50 tok/s next to minillm and llama.cpp in
one process, 350 tok/s in a process of its own. So each contender lives in one long-lived worker
process (``Worker``), driven over a pipe, all of them with the same thread count. Long-lived rather
than a fresh process per repeat: loading torch and transformers, or compiling minillm's kernels for
another CPU, takes 10-60 s, which a fresh process would pay on every repeat (the full decode run
must fit in ~12 minutes); a worker pays it once and is warmed up before it is timed, and between
turns it blocks on its pipe, so its threads go to sleep.

Both code paths from one AVX-512 machine: ``--isa avx2`` starts every contender with ``ISA_ENV
["avx2"]`` - Numba compiles for Haswell with Haswell's features, PyTorch's kernels and oneDNN stop at AVX2, and llama.cpp
comes from an AVX2-only build (``benchmarks/build_peers.sh avx2``). Each worker reports what its
engine really ran (Numba's compile target, torch's CPU capability, llama.cpp's system info), and
that report goes into the result file next to the host's description.
"""
from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from minillm import fingerprint as minillm_fingerprint
from minillm.hardware.machine import compile_target, describe_machine, package_versions

BENCHMARKS = Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent
RESULTS = BENCHMARKS / "results"
LLAMA_CPP_AVX2 = ROOT / ".venv-peers-avx2"  # benchmarks/build_peers.sh avx2

THREAD_VARS = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# What each code path sets; "native" clears them all, so a variable left in the shell cannot leak in.
ISA_ENV = {
    "native": {},
    # NUMBA_CPU_NAME alone keeps the host's feature list (512-bit code still); an empty
    # NUMBA_CPU_FEATURES takes Haswell's own (minillm.hardware.machine.CompileTarget)
    # PyTorch's fp32 GEMM is MKL's, which ATEN_CPU_CAPABILITY and oneDNN's limit do not reach: without
    # MKL_ENABLE_INSTRUCTIONS an "AVX2" transformers ran AVX-512 GEMMs (a 512 x 576 x 1536 linear,
    # 2 threads, Xeon VM: 357 GFLOP/s with the first two set, 232 with all three)
    "avx2": {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "", "ATEN_CPU_CAPABILITY": "avx2",
             "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "OPENBLAS_CORETYPE": "Haswell"},
}
ISA_VARS = tuple(sorted({var for env in ISA_ENV.values() for var in env}))
FIRST_ORDINARY_ID, LAST_PROMPT_ID = 17, 10_000  # random prompt ids: past SmolLM2's 17 control tokens
SETTLE_SECONDS = 0.5  # between turns: the previous contender's threads spin for up to ~200 ms after a call


# -----------------------------------------------------------------------------------------------
# The timer

def timed(fn: Callable, *args, **kwargs) -> tuple[object, float]:
    """(fn's result, wall seconds of the call)."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def seconds_per_call(fn: Callable[[], object], samples: int, sample_seconds: float = 1e-3) -> list[float]:
    """Seconds per call of fn in each of `samples` samples; a sample repeats fn until it lasts about
    sample_seconds, so calls of microseconds are not lost in the timer's resolution. Two untimed
    calls first: compile, fault the operands in, wake the thread pool."""
    fn()
    _, once = timed(fn)
    calls = max(1, int(sample_seconds / max(once, 1e-7)))

    def sample() -> None:
        for _ in range(calls):
            fn()

    return [timed(sample)[1] / calls for _ in range(samples)]


# -----------------------------------------------------------------------------------------------
# Threads and instruction sets

def default_threads() -> int:
    """Physical cores, or fewer if NUMBA_NUM_THREADS asks for fewer (the one knob for every contender)."""
    cores = describe_machine().cores
    return min(cores, int(os.environ.get("NUMBA_NUM_THREADS", cores)))


def contender_env(isa: str, threads: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a contender's process: `threads` threads for every runtime, the `isa` code path."""
    if isa not in ISA_ENV:
        raise ValueError(f"unknown isa {isa!r}: expected one of {', '.join(ISA_ENV)}")
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in ISA_VARS}
    env.update(dict.fromkeys(THREAD_VARS, str(threads)), **ISA_ENV[isa])
    return env


def host_stamp() -> dict:
    """The host: CPU name, cores, memory, its vector features, and what Numba compiles for in this process."""
    machine = describe_machine()
    return {"cpu": machine.cpu_model, "architecture": machine.architecture, "llvm_cpu": machine.llvm_cpu,
            "cores": machine.cores, "memory_bytes": machine.memory_bytes, "simd": list(machine.simd),
            "simd_width_bits": machine.simd_width_bits, "numba_target": numba_target()}


def numba_target() -> dict:
    """What Numba compiles for in this process (``NUMBA_CPU_NAME`` honoured)."""
    target = compile_target()
    return {**asdict(target), "isa": target.isa}


def result_name(benchmark: str, isa: str = "native", activations: str = "fp32") -> str:
    """A results file's name: the benchmark's, then _<isa> for another code path than the host's and
    _<activations> for another minillm mode than fp32 (decode_profile_avx2_int8)."""
    return benchmark + ("" if isa == "native" else f"_{isa}") + ("" if activations == "fp32" else f"_{activations}")


def save_result(name: str, results: dict, out_dir: Path = RESULTS) -> Path:
    """Write ``<out_dir>/<name>.json`` stamped with the date, the host (CPU, microarchitecture, vector
    features, the ISA Numba targeted, cores), the package fingerprint measured and the versions: a
    chapter prints a committed figure only with this stamp (minillm/course/committed.py)."""
    payload = {"benchmark": name, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "machine": host_stamp(), "fingerprint": minillm_fingerprint(), "versions": package_versions(),
               "results": results}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"saved {path}")
    return path


# -----------------------------------------------------------------------------------------------
# Contenders in processes of their own

@dataclass(frozen=True)
class Contender:
    """Which class to build in the worker, from which file, with which arguments.

    The class is built as ``cls(threads=..., **kwargs)``; the worker then calls its methods by name.
    Its ``stamp()`` says what the engine runs on, with ``"isa"`` the code path it really took
    ("avx512", "avx2", ...; see ``benchmarks/contenders.py``). ``paths`` puts a separate build first
    on the import path for a code path (llama.cpp's AVX2 build).
    """
    name: str
    cls: str
    kwargs: dict = field(default_factory=dict)
    source: Path = BENCHMARKS / "contenders.py"
    paths: dict[str, tuple[Path, ...]] = field(default_factory=dict)


def minillm(mode: str = "fp32") -> Contender:
    return Contender(f"minillm {mode}", "Minillm", {"mode": mode})


TRANSFORMERS = Contender("transformers", "Transformers")
LLAMA_CPP = Contender("llama.cpp", "LlamaCpp", paths={"avx2": (LLAMA_CPP_AVX2,)})


class ContenderUnavailable(RuntimeError):
    """The contender could not be built in its process (a peer not installed, a mode not supported)."""


class Worker:
    """One contender in a process of its own, driven over a pipe with one JSON line per call.

    The worker's stdout is the reply pipe; what the engine prints goes to stderr.
    """

    def __init__(self, contender: Contender, isa: str, threads: int):
        self.name, self.isa = contender.name, isa
        env = contender_env(isa, threads)
        paths = contender.paths.get(isa, ())
        for path in paths:
            if not path.is_dir():
                raise ContenderUnavailable(f"{self.name} ({isa}): no build at {path} (benchmarks/build_peers.sh {isa})")
        if paths:
            env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), *filter(None, [env.get("PYTHONPATH")])])
        spec = {"source": str(contender.source), "cls": contender.cls, "kwargs": contender.kwargs,
                "threads": threads}
        self.process = subprocess.Popen([sys.executable, str(BENCHMARKS / "worker.py"), json.dumps(spec)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        hello = self._reply()
        if "error" in hello:
            self.close()
            raise ContenderUnavailable(f"{self.name} ({isa}): {hello['error']}")
        self.stamp = hello["stamp"]

    def _reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker died (exit code {self.process.wait()}); its stderr says why")
        return json.loads(line)

    def call(self, method: str, **kwargs) -> tuple[object, float]:
        """(the method's result, its wall seconds, timed inside the worker)."""
        self.process.stdin.write(json.dumps({"method": method, "kwargs": kwargs}) + "\n")
        self.process.stdin.flush()
        reply = self._reply()
        if "error" in reply:
            raise RuntimeError(f"{self.name}.{method} failed in its process: {reply['error']}")
        return reply["result"], reply["seconds"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=60)


def start_workers(contenders: Sequence[Contender], isa: str, threads: int) -> list[Worker]:
    """A worker per contender; one that cannot be built is skipped with its reason."""
    workers = []
    for contender in contenders:
        try:
            worker = Worker(contender, isa, threads)
        except ContenderUnavailable as err:
            print(f"skipping {err}")
            continue
        if isa != "native" and worker.stamp["isa"] != isa:  # e.g. a llama.cpp build with AVX-512 on
            print(f"skipping {contender.name} ({isa}): it runs {worker.stamp['isa']} code ({worker.stamp})")
            worker.close()
            continue
        workers.append(worker)
    return workers


def start_all(contenders: Sequence[Contender], isa: str, threads: int) -> dict[str, Worker]:
    """A worker per contender, by name, for comparisons that need every one: exits if one cannot start."""
    workers = {w.name: w for w in start_workers(contenders, isa, threads)}
    if len(workers) != len(contenders):
        for worker in workers.values():
            worker.close()
        raise SystemExit("every contender is needed here: see the message above")
    return workers


def take_turns(workers: dict[str, Worker], turns: int, method: str, **kwargs) -> dict[str, list]:
    """Every worker's `method` (which returns {contender: value}), called `turns` times, the workers
    rotating with a pause before each call -> each contender's values, one per turn."""
    values: dict[str, list] = {}
    for _, name in interleaved(list(workers), turns):
        time.sleep(SETTLE_SECONDS)
        for contender, value in workers[name].call(method, **kwargs)[0].items():
            values.setdefault(contender, []).append(value)
    return values


def add_isa_and_out(parser: argparse.ArgumentParser, result: str) -> None:
    """The options every side-by-side benchmark shares: the code path, and where the result file goes."""
    parser.add_argument("--isa", choices=list(ISA_ENV), default="native",
                        help="the code path: native, or avx2 (see benchmarks/decode.py)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"folder for {result}.json (default: {RESULTS})")


def random_prompt(rng: np.random.Generator, length: int) -> list[int]:
    """`length` random ordinary token ids: a fresh prompt, which no prefix cache has seen."""
    return rng.integers(FIRST_ORDINARY_ID, LAST_PROMPT_ID, length).tolist()


def interleaved(names: Sequence[str], repeats: int) -> Iterator[tuple[int, str]]:
    """(repeat, name) in the order A, B, C, A, B, C, ...: a noisy moment hurts every contender alike."""
    for repeat in range(repeats):
        for name in names:
            yield repeat, name


# -----------------------------------------------------------------------------------------------
# Medians and ratios

def summarize(values: Sequence[float]) -> dict:
    """The median of the repeats, and every repeat."""
    return {"median": statistics.median(values), "all": list(values)}


def ratios(medians: dict[str, float], ours: str) -> dict[str, float]:
    """ours / each other contender (> 1: ours is faster, for rates such as tokens/s)."""
    return {other: medians[ours] / value for other, value in medians.items() if other != ours}


def load_module(source: Path):
    """Import a file as a module named after it (the worker builds contenders from files it is told)."""
    spec = importlib.util.spec_from_file_location(source.stem, source)
    module = importlib.util.module_from_spec(spec)
    sys.modules[source.stem] = module  # before it runs: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
