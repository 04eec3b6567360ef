"""Grading a task: its tests, run on the learner's code in a fresh process; and, after trying,
the package's solution."""
from __future__ import annotations

import ast
import hashlib
import inspect
import os
import re
import shlex
import subprocess
import sys
import tempfile
import textwrap
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from minillm.course import ledger
from minillm.course.exercises_backend import CHECKOUT
from minillm.course.tasks import chapter_of, solutions, task

CUDA_CHAPTERS = ("ch03",)  # their tests live in tests/cuda and need the simulator without a GPU


@dataclass
class TestOutcome:
    name: str
    status: str  # "PASS", "FAIL", "NOT YET" (a blank stub raised NotImplementedError) or "SKIPPED"
    message: str = ""


@dataclass(repr=False)
class CheckResult:
    marker: str
    command: str
    tests: list[TestOutcome] = field(default_factory=list)
    output: str = ""  # pytest's own report, for when no test ran at all
    impl: str = "exercises"

    @property
    def passed(self) -> bool:
        return bool(self.tests) and all(t.status == "PASS" for t in self.tests)

    @property
    def verdict(self) -> str:
        if self.passed:
            return "PASSED"
        if not self.tests:
            return "NO TEST RAN"
        return "FAILING" if any(t.status == "FAIL" for t in self.tests) else "NOT YET"

    @property
    def whose(self) -> str:
        return "your code" if self.impl == "exercises" else "the package"

    def __repr__(self) -> str:
        # one line: a notebook cell ending with check(...) echoes it under the printed table
        passing = sum(t.status == "PASS" for t in self.tests)
        return f"CheckResult({self.marker} on {self.whose}: {self.verdict} - {passing} of {len(self.tests)} tests pass)"


def test_files(marker: str) -> list[Path]:
    """The test files that mention the marker (collecting only these keeps a check quick)."""
    folder = CHECKOUT / "tests" / ("cuda" if chapter_of(marker) in CUDA_CHAPTERS else "")
    mark = re.compile(rf"\bmark\.{marker}\b")
    return sorted(p for p in folder.glob("test_*.py") if mark.search(p.read_text()))


def check_command(marker: str, impl: str = "exercises") -> tuple[list[str], dict[str, str]]:
    """The pytest command line that grades a task, and the environment it adds."""
    task(marker)  # an unknown marker fails here, by name
    files = [str(p.relative_to(CHECKOUT)) for p in test_files(marker)] or ["tests"]
    env = {"NUMBA_ENABLE_CUDASIM": "1"} if chapter_of(marker) in CUDA_CHAPTERS else {}
    return [sys.executable, "-m", "pytest", *files, "-m", marker, f"--impl={impl}"], env


# Left out of a check's pytest: the nbval plugin imports nbformat -> jsonschema -> rfc3987_syntax,
# 6.1 s of the 34 s a ch02_rmsnorm check spent importing (python -X importtime, load average 19 on
# 2 cores), for notebooks a check never collects; without it the check took 9.9 s of CPU instead of
# 13.0 s, 53 s of wall time instead of 67 s (medians of 3, interleaved, load 11-16); and the cache
# of last failures, which a check never reads.
PYTEST_PLUGINS_OFF = ("-p", "no:nbval", "-p", "no:cacheprovider")


def check(marker: str, impl: str = "exercises", quiet: bool = False) -> CheckResult:
    """Run the task's tests on the learner's code (impl="minillm": on the package's) in a fresh
    process from the repository root; print one line per test and the command; record a pass or
    a failure of the learner's code in the ledger. Failing tests are reported, never raised."""
    argv, env = check_command(marker, impl)
    shown = " ".join([*(f"{k}={v}" for k, v in env.items()), _shown_python(argv[0]), *map(shlex.quote, argv[1:])])
    graded = exercise_digest(marker) if impl == "exercises" else None  # before the run: a later edit counts as a change
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        run = subprocess.run([*argv, "-q", *PYTEST_PLUGINS_OFF, f"--junitxml={report}"], cwd=CHECKOUT,
                             capture_output=True, text=True, env={**os.environ, **env})
        tests = _outcomes(report) if report.exists() else []
    result = CheckResult(marker, shown, tests, run.stdout[-3000:] + run.stderr[-3000:], impl)
    if impl == "exercises":
        ledger.record(marker, passed=result.passed, checked=time.strftime("%Y-%m-%d %H:%M:%S"), checked_sha256=graded)
    if not quiet:
        _print(result)
    return result


def exercise_digest(marker: str) -> str:
    """sha256 of the learner's exercise file that holds the task: a check's verdict stands while it is unchanged."""
    module, _ = task(marker)
    return hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest()


def passes(marker: str) -> tuple[bool, str]:
    """Whether the learner's version of the task passes its tests, and by which check: the ledger's
    last check of it if the exercise file has not changed since (a check is a pytest process of
    tens of seconds), otherwise a fresh, quiet one."""
    entry = ledger.read_ledger().get(marker, {})
    if entry.get("checked_sha256") == exercise_digest(marker):
        return entry["passed"], f"your check of {entry['checked']} (the exercise file is unchanged since)"
    return check(marker, quiet=True).passed, "a fresh check"


def _shown_python(python: str) -> str:
    path = Path(python)
    return str(path.relative_to(CHECKOUT)) if path.is_relative_to(CHECKOUT) else "python"


def _outcomes(report: Path) -> list[TestOutcome]:
    outcomes = []
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name")
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if case.find("skipped") is not None:
            outcomes.append(TestOutcome(name, "SKIPPED", case.find("skipped").get("message", "")))
        elif problem is None:
            outcomes.append(TestOutcome(name, "PASS"))
        else:
            text = problem.get("message", "") + "\n" + (problem.text or "")
            status = "NOT YET" if "NotImplementedError" in text else "FAIL"
            outcomes.append(TestOutcome(name, status, problem.get("message", "").splitlines()[0][:160]
                                        if problem.get("message") else ""))
    return outcomes


def _print(result: CheckResult) -> None:
    for t in result.tests:
        print(f"{t.status:<8} {t.name}" + (f"  - {t.message}" if t.status == "FAIL" and t.message else ""))
    if not result.tests:
        print(f"no test ran; pytest said:\n{result.output}")
    verdict = "passed" if result.passed else "not passed yet"
    print(f"{result.marker} on {result.whose}: {verdict} "
          f"({sum(t.status == 'PASS' for t in result.tests)}/{len(result.tests)} tests)")
    print(f"command: {result.command}")


EXCERPT_LINES = 25  # what a chapter prints of a piece of the package: its core, never a whole class


def show(*objects, focus: str | None = None, lines: int = EXCERPT_LINES) -> None:
    """Print an excerpt of the package's source of each object (a function, a Numba kernel, a
    method; a class as its outline) under its dotted name and file:line: at most ``lines`` lines of
    code, the docstring and blank lines left out, starting at the first line containing ``focus`` if given. The
    chapters display the code they teach, never a copy of it; the file:line says where to read on."""
    for obj in objects:
        # a Numba dispatcher keeps the Python it compiled; an @intrinsic wraps its typing function
        source = getattr(obj, "py_func", None) or inspect.unwrap(obj)
        _print_excerpt(f"{source.__module__}.{source.__qualname__}", source, focus, lines)


def show_solution(marker: str, focus: str | None = None, lines: int = EXCERPT_LINES) -> None:
    """Print an excerpt of the package's solution of the task (call it after you have tried)."""
    module, _ = task(marker)
    for name, obj in solutions(marker).items():
        _print_excerpt(f"Solution - {marker}: {module.REFERENCE[name]}", getattr(obj, "py_func", obj), focus, lines)


def excerpt(obj, focus: str | None = None, lines: int = EXCERPT_LINES) -> tuple[str, list[str]]:
    """(``path:first-last`` of the whole definition, the lines to print) for a function or a class.

    A function: its signature and body without the docstring, from ``focus`` on if given, cut at
    ``lines`` with a last line saying how many lines and where the rest is. A class: its first line,
    the first line of its docstring and one line per method with its line number (a class is read
    method by method); with ``focus``, its lines from there on, cut as a function's are."""
    source, first = inspect.getsourcelines(obj)
    path = Path(inspect.getsourcefile(obj))
    where = f"{path.relative_to(CHECKOUT) if path.is_relative_to(CHECKOUT) else path}"
    span = f"{where}:{first}-{first + len(source) - 1}"
    node = ast.parse(textwrap.dedent("".join(source))).body[0]
    header_end = _header_end(source, node)
    header = [text.rstrip() for text in source[:header_end]]
    if isinstance(node, ast.ClassDef) and focus is None:
        doc = (ast.get_docstring(node) or "").strip().splitlines()
        outline = header + ([f'    """{doc[0]}"""'] if doc else [])
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                outline.append(f"{source[item.lineno - 1].rstrip()}  ...  # {where}:{first + item.lineno - 1}")
        return span, outline
    docstring = set().union(*(_docstring_lines(n) for n in ast.walk(node)  # and those of a class's methods
                              if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))))
    body = [(first + i, source[i].rstrip()) for i in range(header_end, len(source))
            if i + 1 not in docstring and source[i].strip()]  # blank lines left out: an excerpt ends at one
    if focus is not None:
        start = next((i for i, (_, text) in enumerate(body) if focus in text), None)
        if start is None:
            raise ValueError(f"{where}: no line of {obj.__qualname__} contains {focus!r}")
        header += ["    ..."] if start else []
        body = body[start:]
    room = max(lines - len(header), 1)
    if len(body) == room + 1:
        room += 1  # the line saying where the rest is would cost as much as the rest
    shown = header + [text for _, text in body[:room]]
    if len(body) > room:
        rest = body[room:]
        shown.append(f"    ... {len(rest)} more lines: {where}:{rest[0][0]}-{rest[-1][0]}")
    return span, shown


def _header_end(source: list[str], node: ast.AST) -> int:
    """The number of lines of a definition's decorators and signature, however many lines the
    signature spans: the comments between it and the first statement belong to the body."""
    start = node.lineno - 1  # the def or class line, after the decorators
    for end in range(start + 1, node.body[0].lineno):
        try:
            ast.parse(textwrap.dedent("".join(source[start:end])) + "\n    pass")
            return end
        except SyntaxError:
            continue
    return node.body[0].lineno - 1


def _docstring_lines(node: ast.AST) -> set[int]:
    """Line numbers (1-based, in the definition's own source) of a function's docstring."""
    body = getattr(node, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return set(range(body[0].lineno, body[0].end_lineno + 1))
    return set()


def _print_excerpt(heading: str, obj, focus: str | None, lines: int) -> None:
    span, shown = excerpt(obj, focus, lines)
    print(f"{heading}  ({span})")
    print("\n".join(shown) + "\n")  # the blank line ends the excerpt (tests/test_course.py counts them)
