"""The course's plumbing: the source fingerprint, grading a task, the ledger, the learner's
backend and seats, SmolLM2 on the learner's code, the committed notebooks' freshness and task
order, each chapter's closing readings, and the bilingual glossary."""
import ast
import dataclasses
import hashlib
import importlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

import minillm
from implementations import REPO, TASK_MARKER, solved_exercises
from minillm import course
from minillm.course import grading, ledger, seats, timing
from minillm.course.tasks import all_tasks, is_blank_stub, solutions
from minillm.kernels.registry import OPS, get_backend

CHAPTERS = sorted((REPO / "chapters").glob("[0-9][0-9]_*.ipynb"))
FINGERPRINT = re.compile(r"minillm fingerprint ([0-9a-f]{12})")


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A ledger of the test's own (the learner's real one is never touched)."""
    monkeypatch.setenv("MINILLM_HOME", str(tmp_path))
    return tmp_path


def learner_module(name):
    return importlib.import_module(f"exercises.{name}")


def copy_package_in(monkeypatch, *chapter_modules):
    """Make the package's own versions the learner's, as if copied into exercises/."""
    for name in chapter_modules:
        module = learner_module(name)
        for attr, dotted in module.REFERENCE.items():
            owner, _, obj = dotted.rpartition(".")
            monkeypatch.setattr(module, attr, getattr(importlib.import_module(owner), obj))


# -----------------------------------------------------------------------------------------------
# the fingerprint


def test_fingerprint_is_twelve_hex_digits_of_the_sources_and_changes_with_them(tmp_path):
    package = REPO / "minillm"
    copy = tmp_path / "minillm"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    fingerprint = minillm.fingerprint()
    assert re.fullmatch(r"[0-9a-f]{12}", fingerprint)
    assert minillm.fingerprint(copy) == fingerprint  # a copy of the same sources
    (copy / "course" / "notes.txt").write_text("not python")  # only *.py counts
    assert minillm.fingerprint(copy) == fingerprint
    layers = copy / "model" / "layers.py"
    layers.write_bytes(layers.read_bytes() + b"\n")
    assert minillm.fingerprint(copy) != fingerprint
    layers.rename(copy / "model" / "layers2.py")  # same bytes, another path
    changed = minillm.fingerprint(copy)
    (copy / "model" / "layers2.py").rename(layers)
    assert minillm.fingerprint(copy) != changed


def test_fingerprint_imports_no_submodule():
    code = "import sys, minillm; minillm.fingerprint(); print([m for m in sys.modules if m.startswith('minillm.')])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_version_cell_prints_one_line_with_the_fingerprint_and_versions(capsys):
    course.version_cell()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    assert FINGERPRINT.search(lines[0]).group(1) == minillm.fingerprint()
    for word in ("python", "numpy", "numba", "torch", "Numba compiles for"):
        assert word in lines[0]


# -----------------------------------------------------------------------------------------------
# tasks, grading and the ledger


def test_blank_stubs_are_told_from_written_code():
    ch07 = learner_module("ch07_paged_kv_cache")
    assert is_blank_stub(ch07.slot_mapping) and is_blank_stub(ch07.BlockPool)
    for obj in solutions("ch07_block_table").values():
        assert not is_blank_stub(obj)

    class HalfWritten:
        def take(self):
            return 0

        @property
        def num_free(self):
            raise NotImplementedError("chapter 7, task 1")

    assert is_blank_stub(HalfWritten)


def test_unknown_task_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown task 'ch02_nope'.*ch02_rmsnorm"):
        course.show_solution("ch02_nope")


def test_check_passes_the_package_and_not_the_blank_stub(home, monkeypatch, capsys):
    on_package = course.check("ch02_rmsnorm", impl="minillm")
    assert on_package.passed and on_package.tests
    assert {t.status for t in on_package.tests} == {"PASS"}
    assert ledger.read_ledger() == {}  # grading the package is not the learner's progress
    on_stubs = course.check("ch02_rmsnorm")
    assert not on_stubs.passed
    assert {t.status for t in on_stubs.tests} == {"NOT YET"}
    assert len(on_stubs.tests) == len(on_package.tests)
    out = capsys.readouterr().out
    assert "NOT YET  test_rms_norm" in out
    assert "command: .venv/bin/python -m pytest tests/test_kernels_cpu.py -m ch02_rmsnorm --impl=exercises" in out
    n = len(on_package.tests)
    assert repr(on_package) == f"CheckResult(ch02_rmsnorm on the package: PASSED - {n} of {n} tests pass)"
    assert repr(on_stubs) == f"CheckResult(ch02_rmsnorm on your code: NOT YET - 0 of {n} tests pass)"
    entry = ledger.read_ledger()["ch02_rmsnorm"]
    assert entry["passed"] is False
    assert entry["checked_sha256"] == hashlib.sha256((REPO / "exercises" / "ch02_cpu_kernels.py").read_bytes()).hexdigest()
    # the file is unchanged since: time_exercise takes this check's verdict instead of running pytest again
    monkeypatch.setattr(grading.subprocess, "run", lambda *a, **k: pytest.fail("time_exercise ran pytest again"))
    assert course.time_exercise("ch02_rmsnorm") is None
    assert f"does not pass its tests yet (your check of {entry['checked']}" in capsys.readouterr().out


def test_check_results_read_as_one_line():
    outcomes = [grading.TestOutcome("a", "PASS"), grading.TestOutcome("b", "FAIL", "assert 1 == 2"),
                grading.TestOutcome("c", "NOT YET")]
    assert repr(grading.CheckResult("ch02_rope", "cmd", outcomes)) == \
        "CheckResult(ch02_rope on your code: FAILING - 1 of 3 tests pass)"
    assert repr(grading.CheckResult("ch02_rope", "cmd", [], "ERROR collecting", "minillm")) == \
        "CheckResult(ch02_rope on the package: NO TEST RAN - 0 of 0 tests pass)"


def test_time_exercise_checks_again_once_the_exercise_file_changed(home, monkeypatch, tmp_path, capsys):
    module = learner_module("ch02_cpu_kernels")
    copy = tmp_path / "ch02_cpu_kernels.py"
    copy.write_bytes((REPO / "exercises" / "ch02_cpu_kernels.py").read_bytes())
    monkeypatch.setattr(module, "__file__", str(copy))  # the learner's file, which this test may edit
    ledger.record("ch02_rmsnorm", passed=False, checked="2026-01-01 00:00:00",
                  checked_sha256=hashlib.sha256(copy.read_bytes()).hexdigest())
    checks = []
    monkeypatch.setattr(grading, "check", lambda marker, quiet: checks.append(marker) or grading.CheckResult(marker, "cmd"))
    course.time_exercise("ch02_rmsnorm")
    assert checks == [] and "your check of 2026-01-01 00:00:00" in capsys.readouterr().out
    copy.write_text(copy.read_text() + "\n# an edit\n")
    course.time_exercise("ch02_rmsnorm")
    assert checks == ["ch02_rmsnorm"] and "a fresh check" in capsys.readouterr().out


def test_cuda_tasks_are_graded_under_the_simulator():
    argv, env = grading.check_command("ch03_vector_add")
    assert env == {"NUMBA_ENABLE_CUDASIM": "1"}
    assert all(arg.startswith("tests/cuda/") for arg in argv[3:argv.index("-m")])


def test_outcomes_are_read_from_junit_xml(tmp_path):
    report = tmp_path / "report.xml"
    report.write_text(
        '<testsuites><testsuite>'
        '<testcase name="a"/>'
        '<testcase name="b"><failure message="NotImplementedError: chapter 2, task 1">trace</failure></testcase>'
        '<testcase name="c"><failure message="assert 1.0 == 2.0&#10;more">trace</failure></testcase>'
        '<testcase name="d"><error message="boom">NotImplementedError deep in the trace</error></testcase>'
        '<testcase name="e"><skipped message="no GPU"/></testcase>'
        '</testsuite></testsuites>')
    ET.parse(report)  # well-formed
    got = [(t.name, t.status, t.message) for t in grading._outcomes(report)]
    assert got == [("a", "PASS", ""), ("b", "NOT YET", "NotImplementedError: chapter 2, task 1"),
                   ("c", "FAIL", "assert 1.0 == 2.0"), ("d", "NOT YET", "boom"), ("e", "SKIPPED", "no GPU")]


def test_show_solution_prints_an_excerpt_under_a_heading_with_file_and_lines(capsys):
    course.show_solution("ch02_rmsnorm")
    out = capsys.readouterr().out
    from minillm.kernels import cpu
    lines, first = inspect.getsourcelines(cpu.rms_norm)
    heading = (f"Solution - ch02_rmsnorm: minillm.kernels.cpu.rms_norm  "
               f"(minillm/kernels/cpu/__init__.py:{first}-{first + len(lines) - 1})\n")
    assert out.startswith(heading)
    assert "def rms_norm(" in out and "shapes.check_rms_norm(x, weight)" in out
    assert '"""' not in out  # the docstring stays in the file


def test_show_cuts_a_long_function_at_25_lines_and_says_where_the_rest_is(capsys):
    from minillm.kernels.cpu import quant
    source, first = inspect.getsourcelines(quant.qlinear)
    course.show(quant._qmatvec_q4_1, lines=6)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("minillm.kernels.cpu.quant._qmatvec_q4_1  (minillm/kernels/cpu/quant.py:")
    body, end = out[1:-1], out[-1]
    assert end == ""  # the blank line that ends an excerpt
    assert body[:2] == ["@njit(cache=True, parallel=True, fastmath=True)", "def _qmatvec_q4_1(data, x, out):"]
    assert len(body) == 7 and re.fullmatch(r"    \.\.\. \d+ more lines: minillm/kernels/cpu/quant\.py:\d+-\d+", body[-1])
    course.show(quant._qmatvec_q4_1, focus="for j in range(16)", lines=5)
    out = capsys.readouterr().out.splitlines()[1:]
    assert out[2] == "    ..." and "for j in range(16)" in out[3]
    with pytest.raises(ValueError, match="no line of _qmatvec_q4_1 contains 'nowhere'"):
        course.show(quant._qmatvec_q4_1, focus="nowhere")


def test_show_prints_a_class_as_its_outline_never_whole(capsys):
    from minillm.hardware.roofline import Roofline
    course.show(Roofline)
    out = capsys.readouterr().out
    assert "class Roofline:" in out and "def ridge_point(self, level: str | None = None) -> float:  ..." in out
    assert "minillm/hardware/roofline.py:" in out
    assert len(out.splitlines()) < len(inspect.getsource(Roofline).splitlines()) / 3


def test_every_excerpt_of_the_package_is_at_most_25_lines_and_a_line_to_say_where_the_rest_is(capsys):
    from minillm.hardware.roofline import Roofline
    from minillm.kernels.cpu import matmul_ladder as cpu_matmul
    from minillm.runtime.scheduler import Scheduler
    for obj in (cpu_matmul._tile_4x4, Roofline.plot, Scheduler):
        course.show(obj)
        assert len(capsys.readouterr().out.splitlines()) <= 1 + grading.EXCERPT_LINES + 2  # heading, + where the rest is, + blank


def test_time_exercise_on_a_blank_stub_records_nothing(home, capsys):
    assert course.time_exercise("ch02_rmsnorm") is None
    assert "does not pass its tests yet" in capsys.readouterr().out
    assert "ratio" not in ledger.read_ledger()["ch02_rmsnorm"]
    assert course.time_exercise("ch08_preemption") is None
    assert "no timing for this task" in capsys.readouterr().out


def test_time_exercise_times_a_passing_version_and_records_it(home, monkeypatch, capsys):
    copy_package_in(monkeypatch, "ch02_cpu_kernels")
    # check() grades the files in exercises/ in a fresh process, which this monkeypatch cannot
    # reach: here it stands for a passing check, so that the timing and the ledger are what is tested.
    monkeypatch.setattr(timing, "passes", lambda marker: (True, "a stand-in check"))
    timed = course.time_exercise("ch02_rmsnorm")
    assert timed.your_s > 0 and timed.package_s > 0
    assert timed.ratio == pytest.approx(timed.your_s / timed.package_s)
    assert ledger.read_ledger()["ch02_rmsnorm"]["ratio"] == timed.ratio
    assert "x the package's time" in capsys.readouterr().out
    assert repr(timed) == f"Timing(ch02_rmsnorm: yours takes {timed.ratio:.2f}x the package's time)"


def test_progress_lists_every_task_with_the_ledger(home, capsys):
    ledger.record("ch02_rmsnorm", passed=True, your_s=2e-3, package_s=1e-3, ratio=2.0)
    assert course.progress() is None  # a cell ending with it shows the table only
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert list(rows) == list(all_tasks())
    assert rows["ch02_rmsnorm"].split()[1:7] == ["yes", "2.000", "ms", "1.000", "ms", "2.00x"]
    assert rows["ch02_softmax"].split()[1] == "-"
    assert str(home / "progress.json") in lines[-1]


def test_the_ledger_has_a_path_of_its_own(home, monkeypatch, tmp_path):
    own = tmp_path / "elsewhere" / "ledger.json"
    monkeypatch.setenv("MINILLM_PROGRESS", str(own))
    ledger.record("ch02_rmsnorm", passed=True)
    assert json.loads(own.read_text())["ch02_rmsnorm"]["passed"] is True
    assert not (home / "progress.json").exists()
    monkeypatch.delenv("MINILLM_PROGRESS")
    assert ledger.read_ledger() == {}  # back to $MINILLM_HOME/progress.json


RECORD_MANY = """
import sys
from minillm.course import ledger
for i in range(3000):
    ledger.record(sys.argv[1], passed=True, count=i)
"""


def test_two_processes_recording_at_once_leave_a_whole_ledger(home):
    """Two notebook kernels checking at the same moment: each writes a file of its own and renames it
    over the ledger, so a reader only ever meets a whole one (with one partial file shared, a writer's
    rename found it already renamed by the other: FileNotFoundError, in the first run here)."""
    writers = [subprocess.Popen([sys.executable, "-c", RECORD_MANY, marker], env=os.environ | {"MINILLM_HOME": str(home)})
               for marker in ("ch02_rmsnorm", "ch02_softmax")]
    reads = 0
    while any(w.poll() is None for w in writers):
        ledger.read_ledger()  # raises on a torn file
        reads += 1
    assert [w.returncode for w in writers] == [0, 0] and reads > 0
    assert not list(home.glob("*.partial"))
    assert ledger.read_ledger().keys() <= {"ch02_rmsnorm", "ch02_softmax"}


@pytest.mark.parametrize("target", ["notebooks", "test-notebooks"])
def test_make_runs_the_notebooks_on_a_fresh_ledger_of_their_own(target, home, tmp_path):
    """The target's real recipe, with .venv's jupyter and python replaced by a script that writes
    down the ledger path it is given and whether that ledger exists."""
    venv, log = tmp_path / "venv", tmp_path / "ledgers.log"
    (venv / "bin").mkdir(parents=True)
    for tool in ("jupyter", "python"):
        script = venv / "bin" / tool
        script.write_text(f'#!/bin/sh\necho "$MINILLM_PROGRESS $(test -e "$MINILLM_PROGRESS" && echo exists)" >> {log}\n')
        script.chmod(0o755)
    (venv / ".installed").touch()
    mine = home / "mine.json"
    mine.write_text("{}")
    subprocess.run(["make", "-o", f"{venv}/.installed", target, f"VENV={venv}"], cwd=REPO, check=True,
                   capture_output=True, env={**os.environ, "MINILLM_PROGRESS": str(mine)})
    runs = log.read_text().splitlines()
    assert len(runs) == (len(CHAPTERS) if target == "notebooks" else 1)
    paths = {line.split()[0] for line in runs}
    assert len(paths) == 1 and all(len(line.split()) == 1 for line in runs)  # one ledger, empty when each started
    ledger_file = Path(paths.pop())
    assert ledger_file != mine and not ledger_file.parent.exists()  # a temporary folder, gone afterwards


def test_a_corrupt_ledger_is_named(home):
    (home / "progress.json").write_text("{")
    with pytest.raises(ValueError, match="progress.json is not valid JSON"):
        ledger.read_ledger()


# -----------------------------------------------------------------------------------------------
# the exercises backend and the seats above the kernels


def test_exercises_backend_on_blank_stubs_is_numba():
    learner, package = get_backend("exercises"), get_backend("numba")
    for op in OPS:
        assert getattr(learner, op) is getattr(package, op), op
    assert not any("yours" in owner for owner in learner.owners.values())
    assert "not written yet" in learner.owners["rms_norm"]


def test_exercises_backend_takes_written_kernels_that_agree(monkeypatch):
    copy_package_in(monkeypatch, "ch02_cpu_kernels", "ch04_quantization", "ch07_paged_kv_cache")
    ch02 = learner_module("ch02_cpu_kernels")
    monkeypatch.setattr(ch02, "softmax", lambda x: np.zeros_like(x))  # written, but wrong
    monkeypatch.setattr(ch02, "rope", lambda *args: 1 / 0)  # written, but crashes
    ops = get_backend("exercises")
    for op in ("rms_norm", "attention_decode", "matmul", "paged_attention_decode"):
        assert ops.owners[op].startswith("yours"), (op, ops.owners[op])
    assert ops.rms_norm is ch02.rms_norm
    assert "disagrees with the reference" in ops.owners["softmax"]
    assert "raised ZeroDivisionError" in ops.owners["rope"]
    assert ops.softmax is get_backend("numba").softmax
    assert ops.tasks["ch02_softmax"] == ops.owners["softmax"] and ops.tasks["ch04_quant_matvec"] == "yours (ch04_quant_matvec)"
    assert ops.owners["qlinear"] == ("decode: yours (ch04_quant_matvec); "
                                     "prefill: yours (ch04_q4_1_dequantize)")
    from minillm.kernels import reference
    from minillm.kernels.cpu import quant
    rng = np.random.default_rng(1)
    qm = quant.quantize(rng.standard_normal((96, 64)).astype(np.float32), "Q4_1")
    for rows in (1, 2, 7):  # both the matvec and the dequantize paths, against the NumPy spec
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        np.testing.assert_allclose(ops.qlinear(x, qm), reference.qlinear(x, qm), rtol=1e-4, atol=1e-4)


def test_learner_seats_swap_written_pieces_and_put_them_back(monkeypatch):
    from minillm.runtime import block_manager, paged_cache

    def my_slot_mapping(block_table, positions, block_size):
        return np.zeros(len(positions), dtype=np.int64)

    monkeypatch.setattr(learner_module("ch07_paged_kv_cache"), "slot_mapping", my_slot_mapping)
    original = paged_cache.slot_mapping
    with seats.learner_seats("ch07") as swapped:
        assert swapped == ["ch07_slot_mapping"]  # blank stubs stay out
        assert paged_cache.slot_mapping is my_slot_mapping
        assert block_manager.BlockPool is not learner_module("ch07_paged_kv_cache").BlockPool
    assert paged_cache.slot_mapping is original
    with pytest.raises(RuntimeError, match="inside"), seats.learner_seats("ch07"):
        raise RuntimeError("inside")
    assert paged_cache.slot_mapping is original
    with seats.learner_seats("ch06") as swapped:  # a later chapter's piece is not used yet
        assert swapped == [] and paged_cache.slot_mapping is original


def test_every_task_has_a_seat_entry_and_every_seat_names_a_real_attribute():
    assert set(seats.SEATS) == set(all_tasks())
    for marker, seat in seats.SEATS.items():
        assert seat.path is not None or seat.note, f"{marker}: no seat and no reason given"
        for module_name, attr in seat.targets:
            assert hasattr(importlib.import_module(module_name), attr), f"{marker}: {module_name}.{attr}"


def test_minillm_exercises_chooses_the_folder_and_a_wrong_one_is_named(tmp_path, monkeypatch):
    from minillm.course import exercises_backend
    from minillm.kernels.registry import BackendUnavailable

    monkeypatch.setattr(sys, "path", list(sys.path))  # learner_module puts the folder's parent on it
    solved = solved_exercises(tmp_path)
    (tmp_path / "mine").mkdir()
    monkeypatch.setenv("MINILLM_EXERCISES", str(tmp_path / "mine"))
    with pytest.raises(BackendUnavailable, match=r"mine is not an exercises/ package.*MINILLM_EXERCISES"):
        exercises_backend.learner_module("ch02_cpu_kernels")
    monkeypatch.setenv("MINILLM_EXERCISES", str(solved))
    assert exercises_backend.exercises_folder() == solved.resolve()
    with pytest.raises(BackendUnavailable, match=re.escape(f"imported exercises from {REPO / 'exercises'}, "
                                                           f"not {solved.resolve()}")):
        exercises_backend.learner_module("ch02_cpu_kernels")  # this process has the checkout's already


@pytest.mark.slow
def test_your_code_on_blank_stubs_says_nothing_is_yours(smollm2_path, capsys):
    result = course.your_code(chapter="ch02", max_tokens=6, model=smollm2_path)
    assert result.yours == [] and result.equal and len(result.your_tokens) == 6
    assert "Nothing is yours yet" in capsys.readouterr().out


YOUR_CODE_JSON = """
import json, sys
from minillm import course
result = course.your_code(chapter=sys.argv[1], max_tokens=8, model=sys.argv[2])
print(json.dumps({"pieces": [p.__dict__ for p in result.pieces], "equal": result.equal,
                  "runs": {name: [package[0], yours[0]] for name, (package, yours) in result.runs.items()},
                  "your_tokens": result.your_tokens, "package_tokens": result.package_tokens,
                  "tensor_parallel": result.runs["tensor_parallel"][1][1]}))
"""


@pytest.mark.slow
def test_your_code_on_the_package_solutions_reaches_every_seated_task(tmp_path, smollm2_path, hf_smollm2):
    solved = solved_exercises(tmp_path)  # run from the checkout: the variable, not the folder, chooses them
    run = subprocess.run([sys.executable, "-c", YOUR_CODE_JSON, "ch12", str(smollm2_path)], cwd=REPO,
                         capture_output=True, text=True, env={**os.environ, "MINILLM_EXERCISES": str(solved)},
                         timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    pieces = {p["task"]: p for p in result["pieces"]}
    assert list(pieces) == list(all_tasks())
    for marker, piece in pieces.items():   # every task has its seat: none is left waiting for a hook
        assert piece["whose"] == "yours" and piece["reached"] > 0, piece
    assert set(result["runs"]) == {"greedy", "sampled", "engine", "serve", "speculate", "speculate_sampled",
                                   "constrained", "cuda", "routing", "tensor_parallel"}
    for name, (package, yours) in result["runs"].items():
        assert package == yours, name
    # the split ran in both tensor-parallel ranks, in every layer of every forward (one a token), by their count
    from minillm.model.loader import read_weights
    how, calls = result["tensor_parallel"]
    (tokens,) = result["runs"]["tensor_parallel"][1]
    assert how == "2 ranks" and calls == [read_weights(smollm2_path)[0].n_layers * len(tokens)] * 2
    assert pieces["ch12_column_row_linear"]["reached"] == sum(calls)
    # and the greedy tokens are SmolLM2's: transformers' greedy continuation of the same prompt
    import torch
    model, tokenizer = hf_smollm2
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        hf = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
    assert result["your_tokens"] == result["package_tokens"] == hf


@pytest.mark.slow
def test_your_code_names_a_wrong_kernel_and_keeps_the_package_tokens(smollm2_path, monkeypatch, capsys):
    copy_package_in(monkeypatch, "ch02_cpu_kernels")
    monkeypatch.setattr(learner_module("ch02_cpu_kernels"), "softmax", lambda x: np.zeros_like(x))  # written, wrong
    result = course.your_code(chapter="ch02", max_tokens=6, model=smollm2_path)
    pieces = {p.task: p for p in result.pieces}
    assert "disagrees with the reference" in pieces["ch02_softmax"].whose and pieces["ch02_softmax"].reached == 0
    for marker in ("ch02_rmsnorm", "ch02_rope", "ch02_tiled_matmul", "ch02_decode_attention"):
        assert pieces[marker].whose == "yours" and pieces[marker].reached > 0, pieces[marker]
    assert result.equal
    assert "ch02_softmax" in capsys.readouterr().out


# -----------------------------------------------------------------------------------------------
# the learner's backend: softmax inside attention, the tiled matmul inside prefill


def test_with_softmax_runs_reference_attention_on_the_given_softmax():
    from minillm.course.learner_ops import Reach, with_softmax
    from minillm.kernels import reference
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((3, 4, 8), (5, 2, 8), (5, 2, 8)))
    reach = Reach()
    attention = with_softmax(reference.attention, reach.counted("ch02_softmax", reference.softmax))
    np.testing.assert_allclose(attention(q, k, v, 2), reference.attention(q, k, v, 2), rtol=1e-6)
    assert reach["ch02_softmax"] == 1
    assert reference.attention.__globals__["softmax"] is reference.softmax  # nothing patched


def test_learner_qlinear_takes_decode_through_qmatvec_and_prefill_through_dequantize_and_matmul():
    from minillm.course.learner_ops import Reach, learner_qlinear
    from minillm.kernels import reference
    from minillm.kernels.cpu import matmul_ladder, quant
    rng = np.random.default_rng(1)
    qm = quant.quantize(rng.standard_normal((96, 64)).astype(np.float32), "Q4_1")
    reach = Reach()
    qlinear = learner_qlinear(reach.counted("mv", quant.qmatvec), reach.counted("dq", quant.dequantize_q4_1),
                              reach.counted("mm", matmul_ladder.matmul_v3_blocked))
    for rows in (1, 2, 7):
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        np.testing.assert_allclose(qlinear(x, qm), reference.qlinear(x, qm), rtol=1e-4, atol=1e-4)
    assert reach == {"mv": 3, "dq": 1, "mm": 1}


# -----------------------------------------------------------------------------------------------
# committed figures and the machine that measured them


def test_committed_result_is_the_file_of_this_microarchitecture(tmp_path, monkeypatch):
    from minillm.course import committed
    for name, llvm_cpu in (("decode", "znver4"), ("decode_zen5", "znver5"), ("decode_xeon", "rocketlake")):
        (tmp_path / f"{name}.json").write_text(json.dumps({"benchmark": "decode", "machine": {"llvm_cpu": llvm_cpu}}))
    (tmp_path / "decode_profile.json").write_text(json.dumps({"benchmark": "decode_profile"}))  # not decode's
    monkeypatch.setattr(committed, "RESULTS", tmp_path)
    assert committed.committed_result("decode", "znver5")["file"] == "decode_zen5.json"
    assert committed.committed_result("decode", "rocketlake")["file"] == "decode_xeon.json"
    assert committed.committed_result("decode", "znver4")["file"] == "decode.json"
    other = committed.committed_result("decode", "neoverse-v2")
    assert other["file"] == "decode.json" and other["same_machine"] is False
    assert "another microarchitecture" in committed.machine_label(other)
    assert committed.committed_result("no_such_benchmark") == {}


def test_a_stale_or_unstamped_figure_is_labelled_and_not_printed_as_current():
    from minillm.course import committed
    stale = {"file": "x.json", "stale": "measured before the kernels", "machine": {"cpu": "AMD EPYC"}}
    line = committed.beside("live 90 us", "165 us", stale)
    assert "165" not in line and "STALE" in line and line.startswith("live 90 us")
    stamped = {"file": "y.json", "date": "2026-12-01T00:00", "fingerprint": "0123456789ab", "same_machine": True,
               "machine": {"cpu": "AMD EPYC", "llvm_cpu": "znver5", "cores": 2, "numba_target": {"isa": "avx512"}}}
    assert committed.stamped(stamped) and not committed.stamped(stale)
    assert committed.beside("live 90 us", "80 us", stamped) == (
        "live 90 us  | committed 80 us on y.json: AMD EPYC, znver5, Numba avx512, 2 cores, minillm 0123456789ab, 2026-12-01")


def test_save_result_stamps_the_machine_and_the_fingerprint(tmp_path):
    common = load_benchmarks_common()
    result = json.loads(common.save_result("probe", {"x": 1}, tmp_path).read_text())
    assert result["fingerprint"] == minillm.fingerprint()
    assert {"cpu", "llvm_cpu", "cores"} <= set(result["machine"]) and result["machine"]["numba_target"]["isa"]
    from minillm.course import committed
    assert committed.stamped(result)


def load_benchmarks_common():
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))  # a folder of scripts, not a package (as test_benchmark_common)
    return importlib.import_module("common")


def test_run_all_fair_makes_every_results_file():
    script = (REPO / "benchmarks" / "run_all_fair.sh").read_text()
    default = set(re.search(r"WHICH=\$\{\*:-([^}]*)\}", script).group(1).split())
    made = {"profile": {"decode_profile", "decode_profile_avx2", "decode_profile_int8", "decode_profile_avx2_int8"},
            "regression": {"regression", "regression_avx2", "regression_int8", "regression_avx2_int8"},
            "structured": {"structured", "structured_coverage"}, "quant_matvec": {"quant_matvec", "quant_matvec_1thread"},
            "throughput": {"throughput", "throughput_int8"},
            "speculative": {"speculative", "speculative_crossover", "speculative_int8", "speculative_crossover_int8"}}
    produced = set().union(*(made.get(name, {name}) for name in default))
    produced |= {"gpu_side_by_side", "kernels_cuda"}  # benchmarks/gpu.sh makes these, on a machine with a GPU
    for path in (REPO / "benchmarks" / "results").glob("*.json"):
        assert json.loads(path.read_text())["benchmark"] in produced, path.name


# -----------------------------------------------------------------------------------------------
# chapter 00's figure


def test_stack_figure_draws_six_layers_and_the_request_path():
    import matplotlib
    matplotlib.use("Agg")
    from minillm.course.figure import stack_figure
    fig = stack_figure()
    texts = " ".join(t.get_text() for t in fig.axes[0].texts)
    for layer in ("1 hardware", "2 operators", "3 model", "4 generation", "5 runtime", "6 serving"):
        assert layer in texts
    steps = [t.get_text() for t in fig.axes[0].texts if re.match(r"\d\. ", t.get_text())]
    order = ["text", "tokenizer", "scheduler", "forward", "kernels", "sampler", "detokenizer", "SSE"]
    assert [s.split(". ", 1)[1].split()[0] for s in steps] == order
    assert all(re.search(r"ch \d\d", s) for s in steps)
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_notebook_cells_show_one_figure_and_no_long_values(home, monkeypatch):
    """Executed as `make notebooks` does (nbclient, the inline backend): draw_stack() renders one
    image, with or without a trailing ';', and progress() and a check result echo at most one line."""
    import nbclient
    import nbformat
    monkeypatch.delenv("MPLBACKEND", raising=False)
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in (
        "from minillm import course\ncourse.draw_stack()", "course.draw_stack();", "course.progress()",
        "from minillm.course.grading import CheckResult, TestOutcome\n"
        "CheckResult('ch02_rmsnorm', 'cmd', [TestOutcome('t', 'NOT YET')])")])
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3").execute()
    outputs = [cell.outputs for cell in notebook.cells]
    images = [sum("image/png" in o.get("data", {}) for o in cell) for cell in outputs[:2]]
    assert images == [1, 1]
    assert not any(o.output_type == "execute_result" for o in outputs[0] + outputs[1] + outputs[2])
    (value,) = [o for o in outputs[3] if o.output_type == "execute_result"]
    assert value.data["text/plain"] == "CheckResult(ch02_rmsnorm on your code: NOT YET - 0 of 1 tests pass)"


# -----------------------------------------------------------------------------------------------
# the committed notebooks: fresh outputs, and each task posed before its solution is shown


def code_cells(notebook: dict) -> list[dict]:
    return [c for c in notebook["cells"] if c["cell_type"] == "code"]


def cell_source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def printed_fingerprint(notebook: dict) -> str | None:
    """The fingerprint that course.version_cell() printed in the first code cell, if it did."""
    cells = code_cells(notebook)
    if not cells:
        return None
    for output in cells[0].get("outputs", []):
        text = output.get("text") or output.get("data", {}).get("text/plain", "")
        match = FINGERPRINT.search("".join(text) if isinstance(text, list) else text)
        if match:
            return match.group(1)
    return None


def parsed(source: str) -> ast.Module:
    """A cell's Python, IPython's magics and shell lines blanked out (they are not Python)."""
    lines = ["" if line.lstrip().startswith(("%", "!")) or line.rstrip().endswith("?") else line
             for line in source.splitlines()]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return ast.Module(body=[], type_ignores=[])


def _called_name(call: ast.Call) -> str | None:
    return call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)


def _dotted(node: ast.AST) -> str:
    return ast.unparse(node)


def cell_roles(source: str, marker: str, solution_paths: list[str]) -> set[str]:
    """{"check"} if the cell grades the task, {"solution"} if it prints the task's solution
    (course.show_solution(marker), or show(...)/inspect.getsource(...) of a solution function)."""
    roles = set()
    for node in ast.walk(parsed(source)):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        name, first = _called_name(node), node.args[0]
        if name in ("check", "show_solution") and isinstance(first, ast.Constant) and first.value == marker:
            roles.add("check" if name == "check" else "solution")
        if name in ("show", "getsource"):
            shown = _dotted(first)
            if any(path == shown or path.endswith("." + shown) for path in solution_paths):
                roles.add("solution")
    return roles


def order_problems(notebook: dict, tasks: dict[str, list[str]]) -> list[str]:
    """For each task (marker -> dotted paths of its solutions): it must be checked in a cell before
    any cell that prints its solution. Returns what is wrong, one line per task."""
    problems = []
    cells = code_cells(notebook)
    for marker, paths in tasks.items():
        checks = [i for i, c in enumerate(cells) if "check" in cell_roles(cell_source(c), marker, paths)]
        shows = [i for i, c in enumerate(cells) if "solution" in cell_roles(cell_source(c), marker, paths)]
        if not checks:
            problems.append(f"{marker}: no cell calls course.check({marker!r})")
        elif shows and shows[0] < checks[0]:
            problems.append(f"{marker}: code cell {shows[0] + 1} prints its solution before "
                            f"cell {checks[0] + 1} poses it (course.check)")
    return problems


def chapter_tasks(notebook_path) -> dict[str, list[str]]:
    chapter = "ch" + notebook_path.name[:2]
    return {marker: list(learner_module(module).REFERENCE[name] for name in learner_module(module).TASKS[marker])
            for marker, module in all_tasks().items() if marker.startswith(chapter + "_")}


def synthetic_notebook(*sources: str) -> dict:
    return {"cells": [{"cell_type": "markdown", "source": "# a chapter"}]
            + [{"cell_type": "code", "source": s, "outputs": []} for s in sources]}


SOLUTION = ["minillm.kernels.cpu.rms_norm"]


@pytest.mark.parametrize("sources, problems", [
    (['course.check("ch02_rmsnorm")', 'course.show_solution("ch02_rmsnorm")'], []),
    (['from minillm import course\n%timeit x\ncourse.check("ch02_rmsnorm")', "show(cpu.rms_norm)"], []),
    (['course.show_solution("ch02_rmsnorm")', 'course.check("ch02_rmsnorm")'],
     ["ch02_rmsnorm: code cell 1 prints its solution before cell 2 poses it (course.check)"]),
    (["print(inspect.getsource(cpu.rms_norm))", 'course.check("ch02_rmsnorm")'],
     ["ch02_rmsnorm: code cell 1 prints its solution before cell 2 poses it (course.check)"]),
    (["show(rms_norm)\n!ls", 'check("ch02_rmsnorm")'],
     ["ch02_rmsnorm: code cell 1 prints its solution before cell 2 poses it (course.check)"]),
    (["show(cpu.softmax)", 'course.check("ch02_rmsnorm")'], []),  # another task's solution
    (["show(cpu.rms_norm)"], ["ch02_rmsnorm: no cell calls course.check('ch02_rmsnorm')"]),
    (['course.check("ch02_softmax")'], ["ch02_rmsnorm: no cell calls course.check('ch02_rmsnorm')"]),
])
def test_order_detection_on_synthetic_notebooks(sources, problems):
    assert order_problems(synthetic_notebook(*sources), {"ch02_rmsnorm": SOLUTION}) == problems


def test_fingerprint_is_read_from_the_first_code_cell():
    notebook = synthetic_notebook("course.version_cell()", "x = 1")
    assert printed_fingerprint(notebook) is None
    notebook["cells"][1]["outputs"] = [{"output_type": "stream", "name": "stdout",
                                        "text": ["minillm fingerprint 0123456789ab · python 3.11\n"]}]
    assert printed_fingerprint(notebook) == "0123456789ab"
    notebook["cells"][2]["outputs"] = notebook["cells"][1]["outputs"]
    notebook["cells"][1]["outputs"] = []
    assert printed_fingerprint(notebook) is None  # only the first code cell counts


@pytest.mark.parametrize("notebook_path", CHAPTERS, ids=lambda p: p.stem)
def test_committed_outputs_come_from_this_code(notebook_path):
    printed = printed_fingerprint(json.loads(notebook_path.read_text()))
    assert printed == minillm.fingerprint(), (
        f"{notebook_path.name}: outputs made by minillm {printed or '(no fingerprint printed)'}, the code is "
        f"{minillm.fingerprint()}: run `make notebooks`")


@pytest.mark.parametrize("notebook_path", [p for p in CHAPTERS if chapter_tasks(p)], ids=lambda p: p.stem)
def test_each_task_is_posed_before_its_solution_is_shown(notebook_path):
    problems = order_problems(json.loads(notebook_path.read_text()), chapter_tasks(notebook_path))
    assert not problems, f"{notebook_path.name}:\n" + "\n".join(problems)


def printed_lines(cell: dict) -> list[str]:
    """The lines a code cell printed: its streams and plain-text results (figures are not lines)."""
    lines = []
    for output in cell.get("outputs", []):
        text = output.get("text") if output.get("output_type") == "stream" else output.get("data", {}).get("text/plain")
        if text:
            lines += ("".join(text) if isinstance(text, list) else text).splitlines()
    return lines


EXCERPT_HEADING = re.compile(r".*  \(\S+\.py:\d+-\d+\)$")  # course.show's heading: name  (file:first-last)


def source_share(notebook: dict) -> tuple[int, int]:
    """(lines of package source the chapter prints, lines it prints): an excerpt is course.show's
    heading and the lines up to the blank line that ends it; inspect.getsource's output
    is not allowed at all (test_each_task_is_posed_before_its_solution_is_shown reads the cells)."""
    shown = printed = 0
    for cell in code_cells(notebook):
        lines = printed_lines(cell)
        printed += len(lines)
        i = 0
        while i < len(lines):
            if EXCERPT_HEADING.fullmatch(lines[i]):
                end = next((j for j in range(i + 1, len(lines)) if not lines[j].strip()), len(lines))
                shown += end - i
                i = end
            else:
                i += 1
    return shown, printed


def solutions_outside_their_section(notebook: dict) -> list[int]:
    """Code cells (numbered from 1) that print a task's solution before the '## Solutions' heading."""
    problems, in_solutions, number = [], False, 0
    for cell in notebook["cells"]:
        if cell["cell_type"] == "markdown":
            in_solutions = in_solutions or cell_source(cell).lstrip().startswith("## Solutions")
            continue
        number += 1
        if not in_solutions and any(isinstance(n, ast.Call) and _called_name(n) == "show_solution"
                                    for n in ast.walk(parsed(cell_source(cell)))):
            problems.append(number)
    return problems


RESULTS_FILE = re.compile(r"benchmarks/results/(\w+)\.json")
COMMITTED_CALL = re.compile(r"committed_(?:result\(\s*[\"'](\w+)[\"']|(decode)\()")


def results_read(text: str) -> set[str]:
    """Names of the benchmarks whose results files a text (a chapter's code, the README) reads."""
    from minillm.course import committed
    names = set()
    for stem in RESULTS_FILE.findall(text):
        path = committed.RESULTS / f"{stem}.json"
        names.add(json.loads(path.read_text())["benchmark"] if path.is_file() else stem)
    names |= {a or b for a, b in COMMITTED_CALL.findall(text)}
    return names


def unstamped_results(names: set[str]) -> list[str]:
    from minillm.course import committed
    return sorted(f for name in names for f, result in committed.results_files(name).items()
                  if not committed.stamped(result))


def test_source_share_and_solution_section_on_a_synthetic_notebook():
    notebook = synthetic_notebook('course.check("ch02_rmsnorm")', 'course.show_solution("ch02_rmsnorm")\nprint(1)')
    notebook["cells"][1]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "a\nb\nc\n"}]
    notebook["cells"][2]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": [
        "Solution - ch02_rmsnorm: minillm.kernels.cpu.rms_norm  (minillm/kernels/cpu/__init__.py:88-95)\n",
        "def rms_norm(x, weight, eps):\n", "    return x\n", "\n", "1\n"]}]
    assert source_share(notebook) == (3, 8)
    assert solutions_outside_their_section(notebook) == [2]
    notebook["cells"].insert(2, {"cell_type": "markdown", "source": "## Solutions\n"})
    assert solutions_outside_their_section(notebook) == []
    assert results_read('x = Path("../benchmarks/results/regression_zen5.json")\ncourse.committed_result("quant_quality")') \
        == {"regression", "quant_quality"}


@pytest.mark.parametrize("notebook_path", CHAPTERS, ids=lambda p: p.stem)
def test_package_source_is_at_most_a_fifth_of_what_a_chapter_prints(notebook_path):
    shown, printed = source_share(json.loads(notebook_path.read_text()))
    assert shown <= 0.2 * printed, f"{notebook_path.name}: {shown} of {printed} printed lines are package source"


@pytest.mark.parametrize("notebook_path", CHAPTERS, ids=lambda p: p.stem)
def test_solutions_live_in_a_final_solutions_section(notebook_path):
    cells = solutions_outside_their_section(json.loads(notebook_path.read_text()))
    assert not cells, f"{notebook_path.name}: code cells {cells} print solutions before '## Solutions'"


@pytest.mark.parametrize("notebook_path", CHAPTERS, ids=lambda p: p.stem)
def test_every_results_file_a_chapter_reads_names_its_machine_and_fingerprint(notebook_path):
    notebook = json.loads(notebook_path.read_text())
    unstamped = unstamped_results(results_read("\n".join(cell_source(c) for c in code_cells(notebook))))
    assert not unstamped, (f"{notebook_path.name} reads {unstamped}, which lack the machine or fingerprint stamp: "
                           "rerun them (benchmarks/run_all_fair.sh) or stop reading them")


def test_every_results_file_the_readme_reads_names_its_machine_and_fingerprint():
    unstamped = unstamped_results(results_read((REPO / "README.md").read_text()))
    assert not unstamped, f"README.md reads {unstamped}, which lack the machine or fingerprint stamp"


def test_every_chapter_with_tasks_has_a_notebook():
    notebooks = {p.name[:2] for p in CHAPTERS}
    chapters = {marker[2:4] for marker in all_tasks() if TASK_MARKER.match(marker)}
    assert chapters <= notebooks, f"tasks of chapters without a notebook: {sorted(chapters - notebooks)}"


def test_make_notebooks_executes_every_chapter_in_order_in_place():
    dry_run = subprocess.run(["make", "-n", "notebooks"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    executed = re.findall(r"nbconvert --to notebook --execute --inplace .*?(chapters/\S+\.ipynb)", dry_run)
    assert executed == [str(p.relative_to(REPO)) for p in CHAPTERS]
    assert "--ExecutePreprocessor.timeout=900" in dry_run  # test-notebooks' cell timeout


# -----------------------------------------------------------------------------------------------
# readings at the end of every chapter, and the glossary

GLOSSARY = REPO / "chapters" / "glossary.md"
LIST_ITEM = re.compile(r"\s*(?:[-*+]|\d+[.)])\s+(.*)")
CITATION = re.compile(r"\]\([^)\s]+\)|https?://|\b(?:19|20)\d\d\b")  # a link, or the year of a reference
HAN = re.compile(r"[\u4e00-\u9fff]")
CHAPTER_CELL = re.compile(r"(\d\d(?:, \d\d)*)( \(planned\))?")  # "04", "06, 09", "10 (planned)"


def markdown_sources(notebook: dict) -> list[str]:
    return [cell_source(c) for c in notebook["cells"] if c["cell_type"] == "markdown"]


def readings_problems(notebook: dict) -> list[str]:
    """The last markdown cell must be headed '## Readings' and list at least two references
    (list items holding a link or a year)."""
    markdown = markdown_sources(notebook)
    last = markdown[-1].strip() if markdown else ""
    if last.splitlines()[:1] != ["## Readings"]:
        return ["the last markdown cell is not headed '## Readings'"]
    items = [m.group(1) for line in last.splitlines() if (m := LIST_ITEM.fullmatch(line))]
    references = [item for item in items if CITATION.search(item)]
    if len(references) < 2:
        return [f"its Readings list {len(references)} reference(s) with a link or a year; at least 2"]
    return []


def markdown_notebook(*sources: str) -> dict:
    return {"cells": [{"cell_type": "markdown", "source": s} for s in sources]
            + [{"cell_type": "code", "source": "course.your_code()", "outputs": []}]}


@pytest.mark.parametrize("sources, ok", [
    (["# 01", "## Readings\n\n- A, \"[T](https://x.org/a)\" — why.\n- B, *Book*, 2009 — why."], True),
    (["# 01", "## Readings\n\n1. [T](t.md) — why.\n2. [U](u.md) — why."], True),
    (["# 01", "## Readings\n\n- [T](https://x.org/a) — the only one."], False),
    (["# 01", "## Readings\n\n- something to read\n- something else"], False),  # no link, no year
    (["## Readings\n\n- [T](https://x.org) 2020\n- [U](https://y.org) 2021", "Next: chapter 02."], False),
    (["# 01", "## Further reading\n\n- [T](https://x.org)\n- [U](https://y.org)"], False),
])
def test_readings_detection_on_synthetic_notebooks(sources, ok):
    assert (readings_problems(markdown_notebook(*sources)) == []) == ok


@pytest.mark.parametrize("notebook_path", CHAPTERS, ids=lambda p: p.stem)
def test_each_chapter_ends_with_its_readings(notebook_path):
    problems = readings_problems(json.loads(notebook_path.read_text(encoding="utf-8")))
    assert not problems, f"{notebook_path.name}: " + "; ".join(problems)


def glossary_rows() -> list[list[str]]:
    """The cells of every row of the glossary's tables, header and rule rows left out."""
    rows = []
    for line in GLOSSARY.read_text(encoding="utf-8").splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells != ["English", "中文", "meaning", "chapter"]:
            rows.append(cells)
    return rows


def test_the_glossary_has_sixty_bilingual_terms_each_with_the_chapter_that_builds_it():
    rows = glossary_rows()
    notebooks = {p.name[:2] for p in CHAPTERS}
    problems = []
    for row in rows:
        if len(row) != 4 or not all(row):
            problems.append(f"not four filled columns (English | 中文 | meaning | chapter): {row}")
            continue
        english, chinese, _, chapter = row
        if not HAN.search(chinese):
            problems.append(f"{english}: no Chinese in {chinese!r}")
        match = CHAPTER_CELL.fullmatch(chapter)
        if not match:
            problems.append(f"{english}: chapter {chapter!r} is not like '04', '06, 09' or '10 (planned)'")
        elif not match.group(2) and (missing := set(match.group(1).split(", ")) - notebooks):
            problems.append(f"{english}: chapter {', '.join(sorted(missing))} has no notebook; mark it (planned)")
    assert not problems, "chapters/glossary.md:\n" + "\n".join(problems)
    terms = [row[0].lower() for row in rows]
    assert len(set(terms)) == len(terms), f"terms listed twice: {sorted({t for t in terms if terms.count(t) > 1})}"
    assert len(rows) >= 60, f"the glossary has {len(rows)} terms; at least 60"


def test_chapter_00_links_the_glossary():
    map_chapter = json.loads((REPO / "chapters" / "00_map.ipynb").read_text(encoding="utf-8"))
    assert any("](glossary.md)" in source for source in markdown_sources(map_chapter))


# -----------------------------------------------------------------------------------------------
# chapter 12's seats (issue 29): the router's rule, seated through router.cache_aware_choice


def ch12_routing(smollm2_path):
    """your_code's routing run on chapter 12's shared-prefix workload: (package's, learner's) outcome, reach."""
    from minillm.course.learner_ops import Reach
    from minillm.llm import load_tokenizer
    your_code_module = sys.modules["minillm.course.your_code"]  # course.your_code is the function
    reach = Reach()
    return your_code_module._routing("ch12", load_tokenizer(smollm2_path), reach), reach


def test_ch12_seat_routing_reaches_a_correct_rule_once_a_request_and_routes_as_the_package(smollm2_path, monkeypatch):
    from minillm.serve import router
    copy_package_in(monkeypatch, "ch12_scale_out")
    package_rule = router.cache_aware_choice
    (package, yours), reach = ch12_routing(smollm2_path)
    (choices,), per_replica = package
    assert yours == package and sum(per_replica) == len(choices) == 24  # SharedPrefixWorkload's 24 requests
    assert set(choices) == {0, 1}
    assert reach["ch12_cache_aware_routing"] == 24   # CacheAware.choose asks the rule once a request
    assert router.cache_aware_choice is package_rule  # put back after the run


@pytest.mark.parametrize("wrong", ["ignores the prefix", "ignores the imbalance limit"])
def test_ch12_seat_a_wrong_routing_rule_changes_the_replicas_chosen(smollm2_path, monkeypatch, wrong):
    from minillm.serve.router import least_loaded

    def my_choice(block_hashes, loads, last_served, max_imbalance):
        if wrong == "ignores the prefix":
            return least_loaded(loads)
        owners = [last_served[h] for h in reversed(block_hashes) if h in last_served]
        return owners[0] if owners else least_loaded(loads)

    monkeypatch.setattr(learner_module("ch12_scale_out"), "cache_aware_choice", my_choice)
    (package, yours), reach = ch12_routing(smollm2_path)
    assert reach["ch12_cache_aware_routing"] == 24
    assert yours[0] != package[0], f"a rule that {wrong} routed as the package's: the seat is not live"
# chapter 09's seats: the server run's SSE reader and latency checks (course/server_run.py);
# the runs themselves are in tests/test_serve_exercises.py


def test_ch09_seat_sse_data_reads_what_the_openai_client_reads():
    from openai._streaming import SSEDecoder

    from minillm.course.server_run import sse_data

    raw = ('data: {"a": 1}\n\n: a comment\ndata: {"b":\ndata: 2}\n\nevent: x\r\ndata:{"c": "d: e"}\r\n\r\n'
           "data: [DONE]\n\n")
    client = [event.data for event in SSEDecoder().iter_bytes([raw.encode()])]
    assert sse_data(raw) == client[:-1] and client[-1] == "[DONE]"
    for broken in ('data: {"a": 1}\n\n', 'data: {"a": 1}\n\ndata: [DONE]\n'):
        with pytest.raises(ValueError):
            sse_data(broken)


def test_ch09_seat_metric_problems_name_each_broken_definition():
    from minillm.course.server_run import metric_problems

    # one request of 4 tokens: first at 0.5 s, then gaps of 0.1, 0.2, 0.3 s, done at 1.1 s
    right = {"ttft_count": 1, "ttft_sum": 0.5, "e2e_count": 1, "e2e_sum": 1.1, "itl_count": 3, "itl_sum": 0.6,
             "tpot_count": 1, "tpot_sum": 0.2}
    assert metric_problems(right, 4, wall=1.2) == []
    for change, words in [({"tpot_sum": 0.6 / 4}, "TPOT is"), ({"itl_sum": 0.5}, "gaps add up"),
                          ({"itl_count": 4}, "ITL observed 4 times, not 3"), ({"ttft_sum": 1.2}, "not 0 < TTFT")]:
        problems = metric_problems({**right, **change}, 4, wall=1.2)
        assert problems and words in problems[0], (change, problems)
    assert "E2E" in metric_problems(right, 4, wall=1.0)[0]  # longer than the client waited


def test_ch09_seat_the_server_imports_no_course_and_exercises_refuses_replicas():
    code = ("import sys, minillm.serve.app, minillm.cli\n"
            "assert not [m for m in sys.modules if m.startswith('minillm.course')], 'serve/ imported the course'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    run = subprocess.run([sys.executable, "-m", "minillm", "serve", "--exercises", "--replicas", "2"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--exercises" in run.stderr and "--replicas" in run.stderr, run.stderr
# issue 29: chapters 10 and 11's pieces in the engine - the speculative verify's acceptance rules,
# and the NFA, DFA and token mask of the guide that constrains SmolLM2

YOUR_CODE = importlib.import_module("minillm.course.your_code")
ENGINE_SEATED = {  # task -> (exercise module, the learner's name, the package's function)
    "ch10_greedy_accept": ("ch10_speculative", "greedy_accept", "minillm.generation.speculative"),
    "ch10_rejection_sampling": ("ch10_speculative", "rejection_sample", "minillm.generation.speculative"),
    "ch11_thompson": ("ch11_structured_output", "thompson", "minillm.generation.constrained.automata"),
    "ch11_subset_construction": ("ch11_structured_output", "determinize", "minillm.generation.constrained.automata"),
    "ch11_token_mask": ("ch11_structured_output", "allowed_tokens", "minillm.generation.constrained.token_index"),
}


def test_the_speculative_and_constrained_seats_are_the_attributes_the_engine_calls(monkeypatch):
    for marker, (exercise, name, owner) in ENGINE_SEATED.items():
        assert seats.SEATS[marker].kind == seats.SWAP and seats.SEATS[marker].targets == ((owner, name),), marker
    def written_piece():
        def piece(*args, **kwargs):
            return None
        return piece

    mine = {marker: written_piece() for marker in ENGINE_SEATED}
    for marker, (exercise, name, _) in ENGINE_SEATED.items():
        monkeypatch.setattr(learner_module(exercise), name, mine[marker])
    with seats.learner_seats("ch11") as swapped:
        assert set(ENGINE_SEATED) <= set(swapped)
        for marker, (_, name, owner) in ENGINE_SEATED.items():
            assert getattr(importlib.import_module(owner), name) is mine[marker], marker
    for marker, (_, name, owner) in ENGINE_SEATED.items():
        assert getattr(importlib.import_module(owner), name) is not mine[marker], f"{marker} was not put back"


@pytest.mark.slow
def test_your_code_runs_the_learners_acceptance_rules_nfa_dfa_and_mask_in_the_engine(smollm2_path, monkeypatch,
                                                                                    capsys):
    calls = {marker: 0 for marker in ENGINE_SEATED}

    def recorded(marker, fn):   # the package's own function, written in by the learner
        def piece(*args, **kwargs):
            calls[marker] += 1
            return fn(*args, **kwargs)
        return piece

    for marker, (exercise, name, owner) in ENGINE_SEATED.items():
        monkeypatch.setattr(learner_module(exercise), name,
                            recorded(marker, getattr(importlib.import_module(owner), name)))
    result = course.your_code(chapter="ch11", max_tokens=8, model=smollm2_path)
    pieces = {p.task: p for p in result.pieces}
    for marker in ENGINE_SEATED:
        assert pieces[marker].whose == "yours" and pieces[marker].reached > 0 and calls[marker] > 0, pieces[marker]
    assert {"speculate", "speculate_sampled", "constrained"} <= set(result.runs)
    assert result.equal, {name: run for name, run in result.runs.items() if run[0][0] != run[1][0]}
    text = YOUR_CODE.load_tokenizer(smollm2_path).decode(result.runs["constrained"][1][0][0], skip_special_tokens=True)
    assert re.fullmatch(YOUR_CODE.CONSTRAINED_REGEX, text), text   # the learner's guide kept to the pattern
    assert "constrained: the same" in capsys.readouterr().out


# The package's own, taken before any seat is swapped: a wrong piece below builds on them (the name
# at the seat is the wrong piece itself while it runs).
from minillm.generation.constrained import automata as package_automata  # noqa: E402
from minillm.generation.constrained.token_index import TRIE_WALK_COMPUTES as package_allowed_tokens  # noqa: E402

PACKAGE_THOMPSON, PACKAGE_DETERMINIZE = package_automata.thompson, package_automata.determinize


def keeps_no_draft_token(draft, target_argmax):   # greedy_accept without the agreeing prefix
    return [int(target_argmax[-1])]


def draws_only_the_bonus_token(draft, q, p, rng):   # rejection_sample without the kept draft tokens
    return [int(rng.choice(p.shape[1], p=p[-1]))]


def thompson_of_the_last_option(node, budget=None):   # an alternation that keeps only its last option
    from minillm.generation.constrained.regex import Alternate, Concat, Repeat

    def last(n):
        if isinstance(n, Alternate):
            return last(n.options[-1])
        if isinstance(n, Concat):
            return Concat(tuple(last(part) for part in n.parts))
        return Repeat(last(n.node), n.lo, n.hi) if isinstance(n, Repeat) else n
    return PACKAGE_THOMPSON(last(node), budget)


def determinize_accepting_the_start(nfa):   # a set accepts when it holds nfa.start, not nfa.accept
    return PACKAGE_DETERMINIZE(dataclasses.replace(nfa, accept=nfa.start))


def one_byte_tokens_only(dfa, state, token_bytes, eos_id=None):   # the same texts, another tokenization
    return [t for t in package_allowed_tokens(dfa, state, token_bytes, eos_id)
            if t == eos_id or len(token_bytes[t]) == 1]


WRONG_PIECES = {"ch10_greedy_accept": (keeps_no_draft_token, "speculate"),
                "ch10_rejection_sampling": (draws_only_the_bonus_token, "speculate_sampled"),
                "ch11_thompson": (thompson_of_the_last_option, "constrained"),
                "ch11_subset_construction": (determinize_accepting_the_start, "constrained"),
                "ch11_token_mask": (one_byte_tokens_only, "constrained")}


@pytest.fixture(scope="module")
def speculating_llm(smollm2_path):
    from minillm.llm import LLM
    llm = LLM(smollm2_path, speculative=YOUR_CODE.SPECULATIVE)
    yield llm
    llm.close()


def engine_run(llm, run: str) -> list[int]:
    """The tokens of your_code's engine run `run` (8 tokens at most)."""
    from minillm.generation.sampling import SamplingParams
    prompt, params = {
        "speculate": (YOUR_CODE.SPECULATE_PROMPT, dict(temperature=0.0)),
        "speculate_sampled": (YOUR_CODE.SPECULATE_PROMPT, YOUR_CODE.SPECULATE_SAMPLED),
        "constrained": (YOUR_CODE.CONSTRAINED_PROMPT, dict(temperature=0.0, guided_regex=YOUR_CODE.CONSTRAINED_REGEX)),
    }[run]
    return llm.generate([prompt], SamplingParams(max_tokens=8, **params), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.slow
@pytest.mark.parametrize("marker", list(WRONG_PIECES))
def test_a_wrong_piece_in_the_speculative_or_constrained_seat_changes_what_the_engine_writes(marker, speculating_llm,
                                                                                           monkeypatch):
    wrong, run = WRONG_PIECES[marker]
    exercise, name, _ = ENGINE_SEATED[marker]
    package = engine_run(speculating_llm, run)
    monkeypatch.setattr(learner_module(exercise), name, wrong)
    with seats.learner_seats("ch11") as swapped:
        assert marker in swapped
        yours = engine_run(speculating_llm, run)
    assert yours != package, f"{marker}: a wrong {name} left the {run} run's tokens unchanged"
    assert engine_run(speculating_llm, run) == package   # put back: the package's tokens again
