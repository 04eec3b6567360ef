"""Chapter 10 exercises: speculative decoding.

Four pieces of speculative decoding, each with exactly the signature of the package's own version
(see REFERENCE; read it after you have tried). Grade your work with

    .venv/bin/python -m pytest tests/test_speculative.py tests/test_block_manager.py \
        -m "ch10_ngram_drafter or ch10_greedy_accept or ch10_rejection_sampling or ch10_kv_rollback" --impl=exercises

Task 1 (ch10_ngram_drafter)       ngram_propose: prompt lookup - what followed the last n tokens before
Task 2 (ch10_greedy_accept)       greedy_accept: the longest agreeing prefix, plus the target's own token
Task 3 (ch10_rejection_sampling)  rejection_sample: keep with min(1, p/q), else draw from max(0, p - q)
Task 4 (ch10_kv_rollback)         release_tail: give back the KV blocks of rejected draft tokens
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from minillm.runtime.block_manager import BlockPool  # noqa: F401  (release_tail's pool)

REFERENCE = {
    "ngram_propose": "minillm.generation.speculative.ngram_propose",
    "greedy_accept": "minillm.generation.speculative.greedy_accept",
    "rejection_sample": "minillm.generation.speculative.rejection_sample",
    "release_tail": "minillm.runtime.block_manager.release_tail",
}

# The functions each task (pytest marker) grades: course.check(marker) runs its tests.
TASKS = {
    "ch10_ngram_drafter": ["ngram_propose"],
    "ch10_greedy_accept": ["greedy_accept"],
    "ch10_rejection_sampling": ["rejection_sample"],
    "ch10_kv_rollback": ["release_tail"],
}


# -----------------------------------------------------------------------------
# Task 1: the n-gram (prompt lookup) drafter

def ngram_propose(token_ids: Sequence[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """The k tokens that followed the latest earlier occurrence of the last n tokens (n = max_n down to min_n).

    The occurrence must end before the last token; no occurrence of any n: []. k < 1 or
    1 <= min_n <= max_n violated: ValueError.
    """
    raise NotImplementedError("Task 1: write ngram_propose")


# -----------------------------------------------------------------------------
# Task 2: greedy acceptance

def greedy_accept(draft: Sequence[int], target_argmax: Sequence[int]) -> list[int]:
    """The draft's longest prefix equal to target_argmax (k + 1,), then the target's token at the first
    mismatch (or after the whole draft). A length mismatch: ValueError."""
    raise NotImplementedError("Task 2: write greedy_accept")


# -----------------------------------------------------------------------------
# Task 3: the rejection-sampling rule

def rejection_sample(draft: Sequence[int], q: np.ndarray, p: np.ndarray, rng: np.random.Generator) -> list[int]:
    """Draft tokens drawn from q (k, V); target distributions p (k + 1, V). Keep token j with probability
    min(1, p_j / q_j); at the first rejection draw from max(0, p_j - q_j) normalised and stop; if all
    are kept, draw one more token from p_k. Use only ``rng`` for randomness."""
    raise NotImplementedError("Task 3: write rejection_sample")


# -----------------------------------------------------------------------------
# Task 4: KV rollback

def release_tail(pool: BlockPool, block_table: Sequence[int], num_tokens: int, block_size: int) -> list[int]:
    """Keep the blocks the first num_tokens tokens occupy; ``pool.release`` every later block (last
    first); return the kept block table."""
    raise NotImplementedError("Task 4: write release_tail")
