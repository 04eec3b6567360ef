"""Chapter 08 exercises: continuous batching.

Three pieces of the engine's step, each with exactly the signature of the package's own version
(see REFERENCE; read it after you have tried). Grade your work with

    .venv/bin/python -m pytest tests/test_ch08_exercises.py \
        -m "ch08_schedule_step or ch08_preemption or ch08_batched_sampling" --impl=exercises

Task 1 (ch08_schedule_step)    Scheduler: one step's batch under a token budget and a sequence cap
Task 2 (ch08_preemption)       choose_victim and Scheduler.preempt: out of KV blocks, who gives way
Task 3 (ch08_batched_sampling) Sampler.sample: one token for every row of a logits batch

Task 2 runs on your Scheduler of task 1: do task 1 first.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence as Seq

import numpy as np

from minillm.generation.sampling import (  # noqa: F401  (chapter 06's pieces, yours to use in task 3)
    SampleResult, SamplingState, TokenLogprobs, apply_penalties, draw, log_softmax, min_p_filter, top_k_filter,
    top_n, top_p_filter,
)
from minillm.runtime.block_manager import BlockManager
from minillm.runtime.scheduler import ScheduledSeq, SchedulerOutput  # noqa: F401  (what schedule returns)
from minillm.runtime.sequence import Sequence, Status  # noqa: F401

REFERENCE = {
    "Scheduler": "minillm.runtime.scheduler.Scheduler",
    "choose_victim": "minillm.runtime.scheduler.choose_victim",
    "Sampler": "minillm.generation.sampling.Sampler",
}

# The functions each task (pytest marker) grades: course.check(marker) runs its tests.
TASKS = {
    "ch08_schedule_step": ["Scheduler"],
    "ch08_preemption": ["choose_victim"],
    "ch08_batched_sampling": ["Sampler"],
}


# -----------------------------------------------------------------------------
# Task 1: one scheduling step

class Scheduler:
    """A first-come-first-served waiting queue, the running set and the block manager.

    State (the tests read these):
      - ``self.block_manager``, ``self.max_num_seqs``, ``self.max_num_batched_tokens``: as given.
        Raise ValueError if either limit is < 1.
      - ``self.waiting``: a ``collections.deque`` of Sequences not admitted yet, oldest first.
      - ``self.running``: a list of admitted Sequences *in admission order* (oldest first).
      - ``self.num_preemptions``: how many preemptions so far (task 2).

    A ``Sequence`` (minillm/runtime/sequence.py) knows its ``seq_id``, ``token_ids`` (prompt then
    output), ``num_tokens``, ``num_computed`` (leading tokens whose K/V are in the cache),
    ``num_uncomputed`` and ``status``. The block manager (chapter 07) gives KV blocks:
    ``can_allocate(seq_id, token_ids)``, ``allocate(...) -> cached tokens``,
    ``num_slots(seq_id)``, ``can_append(seq_id)``, ``append_slot(seq_id, token_ids) -> (slot,
    copy)``, ``mark_computed(seq_id, token_ids, n)``, ``free(seq_id)``.

    Methods:
      add(seq)                   queue a new sequence at the back of ``waiting``.
      has_unfinished() -> bool   anything waiting or running.
      schedule() -> SchedulerOutput
                                 the next step's batch (below).
      mark_computed(scheduled)   after the forward: for each ScheduledSeq, ``num_computed`` grows by
                                 ``num_new`` and the block manager is told (``mark_computed``), so
                                 full blocks become reusable by other prompts.
      finish(seq)                a finished (or aborted) sequence leaves ``running`` (freeing its
                                 blocks) or ``waiting``; its status becomes FINISHED.
      preempt(seq)               task 2.

    ``schedule`` builds one batch under two limits: ``budget = max_num_batched_tokens`` tokens in
    all, and at most ``max_num_seqs`` sequences running.

      1. Every running sequence, oldest first, while budget is left:
         - if it holds fewer slots than tokens (``bm.num_slots(id) < seq.num_tokens``) it is
           decoding: its newest token needs a slot. Take one with ``bm.append_slot(id,
           seq.token_ids)``; if the returned copy is not None, add it to ``out.copies``. It
           runs 1 token. (Out of blocks - ``not bm.can_append(id)`` - is task 2: preempt
           ``choose_victim(self.running)`` with ``self.preempt`` and record it in
           ``out.preempted`` until the sequence can append; if the sequence itself was the
           victim, stop step 1 - every sequence after it was preempted before it.)
         - otherwise it is in the middle of a prompt (chunked prefill): it runs
           ``min(seq.num_uncomputed, budget)`` tokens.
         Append ``ScheduledSeq(seq, num_new)`` to ``out.scheduled`` and take num_new off the budget.
      2. Then admit waiting sequences from the head of the queue, while budget is left, fewer
         than ``max_num_seqs`` are running, nothing was preempted in this step, and the block
         manager can allocate the head's ``token_ids``. Stop at the first that does not fit -
         first come, first served, no overtaking. Admitting: ``bm.allocate`` returns how many
         leading tokens were found in the prefix cache, which become ``seq.num_computed``;
         the status becomes RUNNING; the sequence joins the end of ``running``; it runs
         ``min(seq.num_uncomputed, budget)`` tokens.

    ``schedule`` changes no ``num_computed`` of a running sequence: ``mark_computed`` does, after the
    forward. Return the SchedulerOutput (an empty one when there is nothing to do).
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int = 32, max_num_batched_tokens: int = 512):
        raise NotImplementedError("chapter 8, task 1")

    def add(self, seq: Sequence) -> None:
        raise NotImplementedError("chapter 8, task 1")

    def has_unfinished(self) -> bool:
        raise NotImplementedError("chapter 8, task 1")

    def schedule(self) -> SchedulerOutput:
        raise NotImplementedError("chapter 8, task 1")

    def mark_computed(self, scheduled: list[ScheduledSeq]) -> None:
        raise NotImplementedError("chapter 8, task 1")

    def preempt(self, seq: Sequence) -> None:
        """Task 2. Preemption by recompute: the sequence gives back all its KV blocks
        (``block_manager.free``), leaves ``running``, and waits at the *front* of ``waiting``
        (``appendleft``: it is older than every waiting request) with status WAITING and
        ``num_computed = 0``: when it is admitted again, its prompt and the output so far are
        prefilled as one long prompt (the prefix cache may still hold some of its blocks).
        Count it in ``seq.num_preemptions`` and ``self.num_preemptions``.
        """
        raise NotImplementedError("chapter 8, task 2")

    def finish(self, seq: Sequence) -> None:
        raise NotImplementedError("chapter 8, task 1")


# -----------------------------------------------------------------------------
# Task 2: whom to preempt

def choose_victim(running: list[Sequence]) -> Sequence:
    """The running sequence to preempt when a sequence needs a KV block and none is free.

    ``running`` is in admission order, oldest first. Choose the most recently admitted one (vLLM's
    policy under first-come-first-served): the oldest requests keep their progress, so every
    request finishes eventually, and the newest has usually computed the least, so recomputing
    it later costs the least. It may be the very sequence that needs the block - then that one
    waits. Do not modify the list: ``Scheduler.preempt`` does the bookkeeping.
    """
    raise NotImplementedError("chapter 8, task 2")


# -----------------------------------------------------------------------------
# Task 3: batched sampling

class Sampler:
    """One token for each row of a (B, V) logits batch, each row with its own SamplingParams.

    ``__init__`` keeps ``eos_token_ids`` (a tuple): the tokens that ``min_tokens`` forbids (with
    each row's ``stop_token_ids``) until the row has produced ``min_tokens`` tokens - unless the
    row's params say ``ignore_eos``, which keeps eos allowed.

    ``sample(logits, states)``: ``logits`` (B, V), ``states`` B ``SamplingState``s (``.params``,
    ``.prompt_ids``, ``.output_ids``, ``.rng``). Raise ValueError unless logits is 2-D with one
    row per state. Per row, in vLLM's order, in float64:
      1. min_tokens: if ``len(state.output_ids) < params.min_tokens``, set the stop ids' logits
         to -inf;
      2. penalties, for rows that have any (``apply_penalties``);
      3. greedy rows (``params.greedy``): argmax, ties to the lowest id (``np.argmax`` does that);
      4. the other rows: divide by the temperature, then ``min_p_filter``, ``top_k_filter``,
         ``top_p_filter`` - each only on the rows that use it (min_p > 0, top_k > 0, top_p < 1)
         - and ``draw`` with one ``state.rng.random()`` per row, in row order. One draw per
         random row and none for greedy rows: that is what makes a seeded request give the same
         tokens whatever else shares its batch.
    Return ``SampleResult(token_ids (B,) int64, logprobs)``: ``logprobs[row]`` is None unless
    ``params.logprobs`` is set, else ``TokenLogprobs`` of the *raw* logits' ``log_softmax``:
    the chosen token's logprob, its rank (1 + the number of tokens more likely than it) and the
    ``params.logprobs`` most likely ids and logprobs (``top_n``).

    Vectorise over rows where it is natural (argmax, the filters take (R, V) batches); a Python
    loop over rows for the per-row draws and logprobs is fine.
    """

    def __init__(self, eos_token_ids: Iterable[int] = ()):
        raise NotImplementedError("chapter 8, task 3")

    def sample(self, logits: np.ndarray, states: Seq[SamplingState]) -> SampleResult:
        raise NotImplementedError("chapter 8, task 3")
