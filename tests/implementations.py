"""Which code the exercise tests grade: the package, or the learner's stubs in exercises/.

A plain module (not conftest.py), so that test files can import it whichever conftest is active.
"""
import importlib
import re
import shutil
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TASK_MARKER = re.compile(r"^ch\d\d_")


def load_implementation(chapter_module: str, impl: str) -> types.ModuleType | types.SimpleNamespace:
    """``exercises.<chapter_module>`` itself (from the folder the course grades: $MINILLM_EXERCISES
    or the checkout's), or the package objects its REFERENCE table names."""
    from minillm.course.exercises_backend import learner_module  # here: collecting tests imports no course

    stubs = learner_module(chapter_module)
    if impl == "exercises":
        return stubs
    resolved = {}
    for name, dotted in stubs.REFERENCE.items():
        module_name, attr = dotted.rsplit(".", 1)
        resolved[name] = getattr(importlib.import_module(module_name), attr)
    return types.SimpleNamespace(**resolved)


def solved_exercises(dest: Path) -> Path:
    """dest/exercises: a copy of the checkout's exercises/ whose every exercise is the package's own
    solution (an import of the object its REFERENCE names, after the stubs) - the learner who copied
    the solutions in. A process with MINILLM_EXERCISES naming it runs the course on it, on the
    checkout's package (and its Numba cache: a copy of the package compiled the engine afresh)."""
    folder = dest / "exercises"
    shutil.copytree(REPO / "exercises", folder, ignore=shutil.ignore_patterns("__pycache__"))
    for path in sorted(folder.glob("ch[0-9][0-9]_*.py")):
        lines = ["", "# the package's own solutions, copied in"]
        for name, dotted in importlib.import_module(f"exercises.{path.stem}").REFERENCE.items():  # the checkout's
            owner, _, attr = dotted.rpartition(".")
            lines.append(f"from {owner} import {attr} as {name}  # noqa: E402,F811")
        path.write_text(path.read_text() + "\n".join(lines) + "\n")
    return folder
