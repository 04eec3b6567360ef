"""Test-suite plumbing: choosing the implementation under test, and the exercise markers.

Every test that grades a learner exercise carries a chapter-task marker (``ch02_rmsnorm`` ...).
It runs against the package by default and against ``exercises/`` with ``--impl=exercises``
(or ``MINILLM_IMPL=exercises``)::

    pytest -m ch02_rmsnorm --impl=exercises
"""
import importlib
import os
import re
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TASK_MARKER = re.compile(r"^ch\d\d_")


def pytest_addoption(parser):
    parser.addoption(
        "--impl",
        choices=("minillm", "exercises"),
        default=os.environ.get("MINILLM_IMPL", "minillm"),
        help="grade the package (default) or the learner's exercises/ stubs",
    )


def pytest_collection_modifyitems(config, items):
    """Tag exercise tests; with --impl=exercises keep only them (nothing else has a stub)."""
    keep, dropped = [], []
    for item in items:
        tasks = [m.name for m in item.iter_markers() if TASK_MARKER.match(m.name)]
        if tasks:
            item.add_marker(pytest.mark.exercise)
            item.user_properties.append(("exercise_tasks", ",".join(sorted(set(tasks)))))
        if tasks or config.getoption("--impl") == "minillm":
            keep.append(item)
        else:
            dropped.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def load_implementation(chapter_module: str, impl: str) -> types.ModuleType | types.SimpleNamespace:
    """``exercises.<chapter_module>`` itself, or the package objects its REFERENCE table names."""
    stubs = importlib.import_module(f"exercises.{chapter_module}")
    if impl == "exercises":
        return stubs
    resolved = {}
    for name, dotted in stubs.REFERENCE.items():
        module_name, attr = dotted.rsplit(".", 1)
        resolved[name] = getattr(importlib.import_module(module_name), attr)
    return types.SimpleNamespace(**resolved)


@pytest.fixture
def impl(request):
    """``impl("ch01_hardware")`` -> the functions an exercise test grades."""
    choice = request.config.getoption("--impl")
    return lambda chapter_module: load_implementation(chapter_module, choice)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 file; `make test` fetches it before the suite runs."""
    from minillm.model.fetch import cached_model_path

    path = cached_model_path()
    if path is None:
        pytest.fail("the default model is not in the cache: run `minillm fetch` (make test does)")
    return path
