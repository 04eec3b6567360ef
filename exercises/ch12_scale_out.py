"""Chapter 12 exercises: beyond one device.

Each task has exactly the signature of the package's own version (see REFERENCE; read it after
you have tried). Grade your work with

    .venv/bin/python -m pytest tests/test_ch12_exercises.py -m ch12_column_row_linear --impl=exercises

Task 1 (ch12_column_row_linear)  column_row_linear: a linear pair split over ranks, one all-reduce
Task 2 (ch12_cache_aware_routing)  cache_aware_choice: the replica most likely to hold a prompt's prefix
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from minillm.model.sharding import shard_range  # noqa: F401  (which rows rank r holds)

REFERENCE = {
    "column_row_linear": "minillm.model.sharding.column_row_linear",
    "cache_aware_choice": "minillm.serve.router.cache_aware_choice",
}

# The functions each task (pytest marker) grades: course.check(marker) runs its tests.
TASKS = {
    "ch12_column_row_linear": ["column_row_linear"],
    "ch12_cache_aware_routing": ["cache_aware_choice"],
}


def column_row_linear(x: np.ndarray, w_in: np.ndarray, w_out: np.ndarray, world_size: int,
                      all_reduce: Callable[[list[np.ndarray]], np.ndarray],
                      activation: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """Task 1: activation(x @ w_in.T) @ w_out.T the tensor-parallel way, each rank in turn.

    x (N, D), w_in (F, D), w_out (D, F). Rank r holds rows ``shard_range(F, world_size, r)`` of
    w_in (column-parallel: its own outputs) and the same columns of w_out (row-parallel: its
    partial sum of every output). The activation is elementwise, so a rank needs no other rank's
    part of the hidden layer. Call ``all_reduce`` once, with the ranks' partial outputs (N, D) in
    rank order, and return what it returns. Raise ValueError if world_size < 1.
    """
    raise NotImplementedError("chapter 12, task 1")


def cache_aware_choice(block_hashes: Sequence[bytes], loads: Sequence[int], last_served: Mapping[bytes, int],
                       max_imbalance: int) -> int:
    """Task 2: the replica (an index into ``loads``) for a request whose leading full blocks hash to
    ``block_hashes`` - chained hashes, first block first, so the k-th stands for the first k blocks.

    ``loads[r]``: requests in flight on replica r. ``last_served``: hash -> the replica that last
    served a prompt with that prefix (it most likely still caches those blocks). Send the request
    to the replica that last served the *longest* of its prefixes found there, unless that
    replica's load exceeds the least-loaded replica's by more than ``max_imbalance``. When it
    does, or when no prefix is known, choose the least-loaded replica (the lowest index among
    equals). Raise ValueError if ``loads`` is empty.
    """
    raise NotImplementedError("chapter 12, task 2")
