"""The benchmark harness (benchmarks/common.py): what can be checked without timing anything.

The order of the turns, the median and ratio arithmetic (against NumPy), the machine stamp (against
/proc/cpuinfo), and that a contender's process gets the thread count and the code path it is given -
checked by a probe contender, defined below, that reports its environment and Numba's thread count
from inside its worker process.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import common  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
from common import (ISA_ENV, THREAD_VARS, Contender, ContenderUnavailable, Worker, contender_env,  # noqa: E402
                    host_stamp, interleaved, ratios, start_all, start_workers, summarize, take_turns)


class Probe:
    """A contender that runs nothing: it reports what its process was given."""

    def __init__(self, threads: int, fail: bool = False, isa: str | None = None, label: str = "probe"):
        if fail:
            raise ValueError("activations='int3' is not supported")
        self.threads, self.isa, self.label = threads, isa, label

    def stamp(self) -> dict:
        import numba

        return {"isa": self.isa or common.numba_target()["isa"], "numba_threads": numba.get_num_threads(),
                "numba_cpu_name": common.numba_target()["cpu_name"]}

    def environ(self) -> dict:
        return dict(os.environ)

    def pid(self) -> dict[str, int]:
        return {self.label: os.getpid()}

    def add(self, a: int, b: int) -> int:
        return a + b

    def divide(self, a: int, b: int) -> float:
        return a / b


def probe(name: str = "probe", **kwargs) -> Contender:
    return Contender(name, "Probe", {"label": name, **kwargs}, source=Path(__file__))


# -----------------------------------------------------------------------------------------------
# order and arithmetic

def test_interleaved_rotates_contenders_within_each_repeat():
    assert list(interleaved(["a", "b", "c"], 3)) == [
        (0, "a"), (0, "b"), (0, "c"), (1, "a"), (1, "b"), (1, "c"), (2, "a"), (2, "b"), (2, "c")]
    assert list(interleaved(["a"], 0)) == []


@pytest.mark.parametrize("values", [[3.0, 1.0, 2.0], [4.0, 1.0, 3.0, 2.0], [7.5]])
def test_summarize_keeps_every_repeat_and_the_median(values):
    summary = summarize(values)
    assert summary["all"] == values
    assert summary["median"] == pytest.approx(float(np.median(values)))


def test_ratios_are_ours_over_each_other():
    medians = {"minillm": 90.0, "transformers": 30.0, "llama.cpp": 120.0}
    assert ratios(medians, "minillm") == pytest.approx({"transformers": 3.0, "llama.cpp": 0.75})


def test_rates_follow_the_protocol():
    """decode: 127 / (t(128 new) - t(1 new)); prefill: 512 / t(1 new after 512)."""
    import decode

    assert decode.decode_tokens_per_s(128, one=0.5, many=1.77) == pytest.approx(100.0)
    assert decode.prefill_tokens_per_s(512, first=2.0) == pytest.approx(256.0)


def test_leading_agreement_counts_shared_greedy_tokens():
    import decode

    assert decode.leading_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert decode.leading_agreement([1, 2], [1, 2, 3]) == 2


def test_comma_lists_are_checked():
    import argparse

    import decode

    assert decode.comma_list(ISA_ENV)("native, avx2") == ["native", "avx2"]
    with pytest.raises(argparse.ArgumentTypeError, match="avx9"):
        decode.comma_list(ISA_ENV)("native,avx9")
    with pytest.raises(argparse.ArgumentTypeError):
        decode.comma_list()(" , ")


# -----------------------------------------------------------------------------------------------
# the stamp

def test_host_stamp_names_the_cpu_and_its_vector_features():
    stamp = host_stamp()
    for key in ("cpu", "architecture", "cores", "simd", "simd_width_bits", "numba_target"):
        assert key in stamp
    assert {"cpu_name", "vector_bits", "vnni", "isa"} <= set(stamp["numba_target"])
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        pytest.skip("no /proc/cpuinfo to compare with")
    text = cpuinfo.read_text()
    flags = set(next(line for line in text.splitlines() if line.startswith("flags")).split(":")[1].split())
    assert stamp["cpu"] in text
    assert ("avx2" in stamp["simd"]) == ("avx2" in flags)
    assert ("avx512f" in stamp["simd"]) == ("avx512f" in flags)
    assert ("avx512vnni" in stamp["simd"]) == ("avx512_vnni" in flags)


def test_save_result_writes_the_stamp(tmp_path):
    import json

    path = common.save_result("probe", {"x": 1}, tmp_path)
    payload = json.loads(path.read_text())
    assert path == tmp_path / "probe.json"
    assert payload["results"] == {"x": 1}
    assert payload["machine"]["simd"] == host_stamp()["simd"]
    assert "numba" in payload["versions"]


# -----------------------------------------------------------------------------------------------
# contenders in processes of their own

def test_contender_env_sets_threads_and_clears_another_code_path():
    base = {"PATH": "/bin", "NUMBA_CPU_NAME": "haswell", "ONEDNN_MAX_CPU_ISA": "AVX2", "NUMBA_NUM_THREADS": "7"}
    native = contender_env("native", 3, base)
    assert {var: native[var] for var in THREAD_VARS} == dict.fromkeys(THREAD_VARS, "3")
    assert "NUMBA_CPU_NAME" not in native and "ONEDNN_MAX_CPU_ISA" not in native and native["PATH"] == "/bin"
    avx2 = contender_env("avx2", 1, base)
    assert avx2["NUMBA_CPU_NAME"] == "haswell" and avx2["ATEN_CPU_CAPABILITY"] == "avx2"
    assert avx2["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    with pytest.raises(ValueError, match="avx9"):
        contender_env("avx9", 1)


@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_a_worker_gets_the_threads_and_code_path_it_is_given(isa, monkeypatch):
    monkeypatch.setenv("NUMBA_CPU_NAME", "znver3")  # left in the shell: must not reach a native contender
    worker = Worker(probe(), isa, threads=1)
    try:
        environ, _ = worker.call("environ")
        assert {var: environ[var] for var in THREAD_VARS} == dict.fromkeys(THREAD_VARS, "1")
        assert worker.stamp["numba_threads"] == 1
        if isa == "avx2":
            assert environ["NUMBA_CPU_NAME"] == "haswell" and environ["NUMBA_CPU_FEATURES"] == ""
            assert worker.stamp["numba_cpu_name"] == "haswell"
            assert worker.stamp["isa"] == "avx2" and environ["ATEN_CPU_CAPABILITY"] == "avx2"
        else:
            assert "NUMBA_CPU_NAME" not in environ and "ATEN_CPU_CAPABILITY" not in environ
            assert worker.stamp["numba_cpu_name"] == common.describe_machine().llvm_cpu
        assert worker.stamp["env"]["NUMBA_NUM_THREADS"] == "1"
        assert worker.process.pid != os.getpid()
        assert environ.get("PYTEST_CURRENT_TEST", "").startswith("tests/test_benchmark_common.py")  # inherited env
    finally:
        worker.close()
    assert worker.process.returncode == 0


def test_a_worker_answers_calls_with_their_result_and_seconds():
    worker = Worker(probe(), "native", threads=1)
    try:
        result, seconds = worker.call("add", a=2, b=3)
        assert result == 5 and seconds >= 0
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):
            worker.call("divide", a=1, b=0)
        assert worker.call("add", a=1, b=1)[0] == 2  # the worker survives a failed call
    finally:
        worker.close()


def test_a_contender_that_cannot_be_built_is_skipped_with_its_reason(capsys):
    with pytest.raises(ContenderUnavailable, match="int3"):
        Worker(probe(fail=True), "native", threads=1)
    workers = start_workers([probe(fail=True), probe()], "native", threads=1)
    try:
        assert len(workers) == 1
        assert "int3" in capsys.readouterr().out
    finally:
        for worker in workers:
            worker.close()


def test_a_contender_running_other_code_than_asked_is_skipped(capsys):
    """An "AVX2" llama.cpp build that still uses AVX-512 must not be measured as AVX2."""
    assert start_workers([probe(isa="avx512")], "avx2", threads=1) == []
    assert "runs avx512 code" in capsys.readouterr().out


def test_a_separate_build_comes_first_on_its_code_path_only(tmp_path):
    """llama.cpp's AVX2 build: first on the import path of the avx2 contender, absent from the native one."""
    contender = Contender("probe", "Probe", source=Path(__file__), paths={"avx2": (tmp_path,)})
    for isa in ("avx2", "native"):
        worker = Worker(contender, isa, threads=1)
        try:
            environ, _ = worker.call("environ")
            paths = environ.get("PYTHONPATH", "").split(os.pathsep)
            assert (paths[0] == str(tmp_path)) if isa == "avx2" else (str(tmp_path) not in paths)
        finally:
            worker.close()
    missing = Contender("probe", "Probe", source=Path(__file__), paths={"avx2": (tmp_path / "absent",)})
    with pytest.raises(ContenderUnavailable, match="build_peers.sh avx2"):
        Worker(missing, "avx2", threads=1)


def test_take_turns_collects_one_value_per_turn_from_each_process():
    workers = start_all([probe("a"), probe("b")], "native", threads=1)
    try:
        values = take_turns(workers, 3, "pid")
        assert set(values) == {"a", "b"} and all(len(v) == 3 for v in values.values())
        assert values["a"] == [workers["a"].process.pid] * 3 and values["b"] == [workers["b"].process.pid] * 3
    finally:
        for worker in workers.values():
            worker.close()


def test_start_all_stops_when_a_needed_contender_cannot_start():
    with pytest.raises(SystemExit, match="every contender"):
        start_all([probe("a"), probe("b", fail=True)], "native", threads=1)
