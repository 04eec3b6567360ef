"""Which code the exercise tests grade: the package, or the learner's stubs in exercises/.

A plain module (not conftest.py), so that test files can import it whichever conftest is active.
"""
import importlib
import re
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TASK_MARKER = re.compile(r"^ch\d\d_")


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
