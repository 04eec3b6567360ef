"""The exercise mechanism is honest: stubs match the package's signatures, and every exercise
test fails on the blank stubs (so passing it means the learner's code does the work)."""
import importlib
import inspect
import os
import pkgutil
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET

import pytest

from implementations import REPO, TASK_MARKER, load_implementation

import exercises

CHAPTER_MODULES = sorted(m.name for m in pkgutil.iter_modules(exercises.__path__) if m.name.startswith("ch"))


def declared_task_markers() -> set[str]:
    markers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    return {m.split(":")[0] for m in markers if TASK_MARKER.match(m)}


@pytest.mark.parametrize("chapter_module", CHAPTER_MODULES)
def test_stub_signatures_match_the_package(chapter_module):
    stubs = importlib.import_module(f"exercises.{chapter_module}")
    reference = load_implementation(chapter_module, "minillm")
    assert stubs.REFERENCE, f"exercises/{chapter_module}.py names no reference"
    for name in stubs.REFERENCE:
        stub, ref = getattr(stubs, name), getattr(reference, name)
        assert inspect.signature(stub) == inspect.signature(ref), f"{chapter_module}.{name}"


def run_exercise_tests_on_stubs(report, paths, extra_env=None):
    """Run the exercise tests against exercises/ in a fresh process; junit XML into `report`."""
    subprocess.run(
        [sys.executable, "-m", "pytest", *map(str, paths), "-m", "exercise", "--impl=exercises",
         "-q", "-p", "no:cacheprovider", f"--junitxml={report}"],
        cwd=REPO, capture_output=True, text=True, timeout=900, env={**os.environ, **(extra_env or {})},
    )
    return list(ET.parse(report).getroot().iter("testcase"))


def test_every_exercise_test_fails_on_the_blank_stubs(tmp_path):
    if not CHAPTER_MODULES:
        pytest.fail("exercises/ holds no chapter module")
    tests = REPO / "tests"
    cases = run_exercise_tests_on_stubs(tmp_path / "cpu.xml", [tests, "--ignore", tests / "cuda"])
    if (tests / "cuda").is_dir():  # the CUDA simulator must be on before numba is imported
        cases += run_exercise_tests_on_stubs(tmp_path / "cuda.xml", [tests / "cuda"], {"NUMBA_ENABLE_CUDASIM": "1"})
    graded_tasks, passed = set(), []
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        failure = case.find("failure") if case.find("failure") is not None else case.find("error")
        if failure is None or "NotImplementedError" not in (failure.get("message", "") + (failure.text or "")):
            passed.append(name)
        for prop in case.iter("property"):
            if prop.get("name") == "exercise_tasks":
                graded_tasks.update(prop.get("value").split(","))
    assert not passed, f"exercise tests that do not fail with NotImplementedError on the stubs: {passed}"
    assert declared_task_markers() <= graded_tasks, (
        f"task markers with no failing test: {sorted(declared_task_markers() - graded_tasks)}"
    )


def test_every_task_marker_has_a_tasks_entry_naming_stub_and_reference():
    tasks = {}
    for chapter_module in CHAPTER_MODULES:
        stubs = importlib.import_module(f"exercises.{chapter_module}")
        for marker, names in stubs.TASKS.items():
            assert marker not in tasks, f"{marker} is in the TASKS of both {tasks.get(marker)} and {chapter_module}"
            assert marker.startswith(chapter_module[:5]), f"{chapter_module}.TASKS holds another chapter's {marker}"
            tasks[marker] = chapter_module
            assert names, f"{chapter_module}.TASKS[{marker!r}] names no function"
            for name in names:
                assert callable(getattr(stubs, name, None)), f"exercises/{chapter_module}.py has no {name} ({marker})"
                assert name in stubs.REFERENCE, f"{chapter_module}.REFERENCE lacks {name} ({marker})"
    assert set(tasks) == declared_task_markers(), (
        f"markers without a TASKS entry: {sorted(declared_task_markers() - set(tasks))}; "
        f"TASKS entries without a marker: {sorted(set(tasks) - declared_task_markers())}"
    )
