"""The real server on the learner's code: chapter 09's pieces where the server calls them, and every
other chapter's in the engine behind it.

    minillm serve --exercises      the OpenAI server on the learner's model, every written piece seated
    minillm chat --exercises       the same engine, in the terminal

(your_code's own run through the server app is ``server_run.py``.) The server's modules are imported
only when a server is built: ``import minillm.course`` stays as light as it was.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from minillm.course.learner_ops import Reach
from minillm.course.seats import CALL, CUDA, ROUTER, SEATS, SINGLE, TENSOR_PARALLEL, learner_seats, tasks_up_to
from minillm.course.tasks import all_tasks, chapter_of
from minillm.course.your_code import _learner_model, _loading, _piece
from minillm.llm import LLM, model_path
from minillm.runtime.config import EngineConfig

LAST_CHAPTER = max(chapter_of(marker) for marker in all_tasks())


# ----------------------------------------------------------------------------------------------
# minillm serve --exercises, minillm chat --exercises

@contextlib.contextmanager
def learner_engine(chapter: str = LAST_CHAPTER) -> Iterator[Callable[[EngineConfig], LLM]]:
    """Within the block, every written piece of chapters 01 .. `chapter` sits in its seat; yields
    ``load``, which builds an LLM from an EngineConfig on the learner's model (the learner's
    kernels, and rope convention, as ``your_code`` runs them). Prints whose each piece is at the
    start, and how often each of the learner's was reached at the end."""
    reach = Reach()

    def load(config: EngineConfig) -> LLM:
        if config.device != "cpu" or config.tensor_parallel_size > 1:
            raise ValueError("--exercises runs your pieces in this process, on the CPU: leave out --device "
                             "and --tensor-parallel-size")
        if config.backend != EngineConfig().backend:
            raise ValueError("--exercises runs on your kernels (the exercises backend): leave out --backend")
        model = _learner_model(model_path(config.model), chapter, reach)
        with _loading(model):
            return LLM(config)

    with learner_seats(chapter, reach):
        pieces = [_piece(marker, reach) for marker in tasks_up_to(chapter)]
        _print_whose(chapter, pieces)
        try:
            yield load
        finally:
            _print_reached([p.task for p in pieces if p.whose == "yours"], reach)


def _outside_the_engine(marker: str) -> bool:
    """Run only by your_code: chapter 01's prediction, chapter 03's CUDA forward, the pieces of its
    single request on a contiguous cache (the engine's cache is paged), and chapter 12's runs (the
    router of a replica set, the tensor-parallel ranks: one served engine has neither)."""
    seat = SEATS[marker]
    return seat.kind in (CALL, CUDA) or seat.path in (SINGLE, ROUTER, TENSOR_PARALLEL)


def _print_whose(chapter: str, pieces) -> None:
    served = [p for p in pieces if not _outside_the_engine(p.task)]
    print(f"minillm on your code, chapters 01-{chapter[2:]}: whose each piece the engine and the server call is")
    width = max(len(p.task) for p in served)
    for p in served:
        print(f"  {p.task:<{width}}  {p.whose[:48]:<48}  {p.where}")
    elsewhere = [p.task for p in pieces if _outside_the_engine(p.task)]
    print(f"  outside the engine (your_code runs them): {', '.join(elsewhere)}", flush=True)


def _print_reached(yours: list[str], reach: Reach) -> None:
    served = [marker for marker in yours if not _outside_the_engine(marker)]
    reached = [f"{marker} {reach[marker]}x" for marker in served if reach[marker]]
    print(f"your pieces reached: {', '.join(reached) or 'none'}")
    if not_reached := [marker for marker in served if not reach[marker]]:
        print(f"not reached by these requests: {', '.join(not_reached)}")
