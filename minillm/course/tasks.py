"""The course's tasks: one pytest marker each, graded on the functions an exercises/ module's
TASKS table names, whose package versions its REFERENCE table names."""
from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from types import ModuleType

from minillm.course.exercises_backend import exercises_folder, learner_module


def chapter_modules() -> list[str]:
    """``ch02_cpu_kernels`` ...: the exercise modules, in chapter order."""
    return sorted(p.stem for p in exercises_folder().glob("ch[0-9][0-9]_*.py"))


def all_tasks() -> dict[str, str]:
    """Every task marker -> the exercise module that holds it, in chapter order."""
    return {marker: module for module in chapter_modules() for marker in learner_module(module).TASKS}


def task(marker: str) -> tuple[ModuleType, list[str]]:
    """The learner's module for a task and the names of the functions (or classes) it grades."""
    tasks = all_tasks()
    if marker not in tasks:
        raise ValueError(f"unknown task {marker!r}; the tasks are: {', '.join(tasks)}")
    module = learner_module(tasks[marker])
    return module, module.TASKS[marker]


def chapter_of(marker: str) -> str:
    """``ch02_rmsnorm`` -> ``ch02``."""
    match = re.match(r"^(ch\d\d)_", marker)
    if not match:
        raise ValueError(f"{marker!r} is not a task marker (chNN_name)")
    return match.group(1)


def package_object(dotted: str):
    """``minillm.kernels.cpu.rms_norm`` -> that function."""
    module_name, attr = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), attr)


def solutions(marker: str) -> dict[str, object]:
    """The package's version of each function a task grades, by exercise name."""
    module, names = task(marker)
    return {name: package_object(module.REFERENCE[name]) for name in names}


def is_blank_stub(obj) -> bool:
    """True for a function whose body (past its docstring) only raises NotImplementedError, and
    for a class with any such method or property: the learner has not written it yet."""
    if inspect.isclass(obj):
        members = [m.fget if isinstance(m, property) else m for m in vars(obj).values()]
        return any(is_blank_stub(m) for m in members if inspect.isfunction(m))
    try:
        source = textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError):  # no source to read (built in, or made at run time): written
        return False
    body = ast.parse(source).body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return (len(body) == 1 and isinstance(body[0], ast.Raise) and body[0].exc is not None
            and "NotImplementedError" in ast.unparse(body[0].exc))
