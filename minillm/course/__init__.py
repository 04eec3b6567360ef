"""The course's plumbing, called from the chapters (it sits on top of the package, beside llm.py):

    from minillm import course
    course.version_cell()                  # the first cell of every chapter
    course.check("ch02_rmsnorm")           # grade your exercise (pytest, in a fresh process)
    course.show_solution("ch02_rmsnorm")   # the package's version, after you have tried
    course.show(cpu.rms_norm)              # the package's source of anything a chapter teaches
    course.time_exercise("ch02_rmsnorm")   # yours against the package's, on SmolLM2's shapes
    course.progress()                      # your ledger ($MINILLM_PROGRESS, or $MINILLM_HOME/progress.json)
    course.your_code(chapter="ch02")       # SmolLM2 generating on your pieces
    course.draw_stack()                    # chapter 00's map of the six layers
    course.committed_decode()              # the committed decode.json figures, beside a live one

Importing it registers the learner's kernel backend, "exercises", with the kernel registry.
"""
from minillm.course import exercises_backend  # noqa: F401  (registers the "exercises" kernel backend)
from minillm.course.committed import committed_decode, committed_result
from minillm.course.figure import draw_stack
from minillm.course.grading import CheckResult, check, show, show_solution
from minillm.course.ledger import progress
from minillm.course.seats import learner_seats
from minillm.course.timing import time_exercise
from minillm.course.version import version_cell
from minillm.course.your_code import your_code

__all__ = ["CheckResult", "check", "committed_decode", "committed_result", "draw_stack", "learner_seats", "progress", "show", "show_solution", "time_exercise",
           "version_cell", "your_code"]
