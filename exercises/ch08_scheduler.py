"""Chapter 08 exercises: continuous batching.

Three pieces of the engine's step, each with exactly the signature of the package's own version
(see REFERENCE; read it after you have tried). Grade your work with

    .venv/bin/python -m pytest tests/test_ch08_exercises.py \
        -m "ch08_schedule_step or ch08_preemption or ch08_batched_sampling" --impl=exercises

Task 1 (ch08_schedule_step)    Scheduler: one step's plan under a token budget and a sequence cap, and
                               what the step did (update_from_output)
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
from minillm.runtime.scheduler import (  # noqa: F401  (the step's messages)
    ADMISSION_SHARE, Emit, RunnerOutput, ScheduledSeq, SchedulerOutput,
)
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
    """The step's owner: which sequences compute which tokens, their KV slots, and what the step did.

    The engine's step is ``plan = schedule()`` -> ``output = runner.execute(plan)`` ->
    ``update_from_output(plan, output, emit)`` -> drafters propose. Your class is the only caller
    of the block manager's allocation (chapter 07): ``can_allocate(id, token_ids)``,
    ``allocate(id, token_ids) -> cached tokens``, ``allocate_slots(id, num_computed_tokens,
    num_new_tokens, num_lookahead_tokens=0) -> copy-on-write pairs, or None when the pool is
    short`` (nothing changed then), ``truncate(id, n)``, ``mark_computed(id, token_ids, n)``,
    ``fork(parent_id, child_id)``, ``free(id)``, ``num_slots(id)``.

    State (the tests read these): ``block_manager``, ``max_num_seqs``, ``max_num_batched_tokens``
    as given (ValueError if either limit is < 1); ``waiting``, a ``collections.deque`` oldest
    first; ``running``, a list in admission order; ``num_preemptions``.

    A ``Sequence`` (minillm/runtime/sequence.py) has no phase. It has ``num_tokens`` tokens
    (``token_ids``: prompt, then output), the first ``num_computed_tokens`` of them in the cache,
    perhaps ``draft_ids`` (a drafter's guesses, to verify) and ``forks`` (n > 1: sequences that
    share its prompt). ``num_tokens_with_spec - num_computed_tokens`` tokens are still to compute.

    schedule() -> SchedulerOutput
        Inputs: the queues. Output: ``scheduled``, a list of ``ScheduledSeq(seq, num_new, draft,
        forks)`` (num_new counts the draft tokens scheduled, the last ``len(draft)`` of them),
        ``copies`` (every copy-on-write pair allocate_slots returned) and ``preempted``.
        Invariants the tests check:
          - at most ``max_num_batched_tokens`` tokens in all, every ScheduledSeq with num_new >= 1,
            at most ``max_num_seqs`` sequences running;
          - every scheduled token has a KV slot;
          - running sequences with one token left to compute (plus their draft, cut to the budget)
            go first, oldest first; then the other running sequences' next chunks, leaving
            ``max_num_batched_tokens // ADMISSION_SHARE`` tokens to admissions while any wait;
            then admissions, first come first served, none overtaking, none while preempting;
          - out of blocks: a draft is dropped first; then ``choose_victim(self.running)`` is
            preempted (task 2), until the slots fit or the sequence itself gave way;
          - an admitted sequence starts at the tokens the prefix cache holds (``allocate``);
          - a sequence whose step computes the end of its prompt lists its ``forks``;
          - nothing's ``num_computed_tokens`` changes but an admitted sequence's.
    update_from_output(plan, output, emit) -> list
        Inputs: the plan; a ``RunnerOutput`` whose ``token_ids[seq_id]`` are the tokens each
        sampling sequence (``ScheduledSeq.samples``) and each fork got - one, or after a verify
        the kept draft tokens then the rule's own; ``emit(seq, token_id, logprobs)``, called
        after each token is appended (``seq.append_token``), returning an object whose
        ``finished`` says the sequence is done. Output: emit's results, in order.
        Invariants: every scheduled token is now computed, rejected draft tokens are not;
        forks are forked (``fork``) before their first token; a sequence whose emit says
        finished is finished (``finish``) and gets no later token; tokens the constraint forces
        (``seq.forced_tokens()``) are appended after the drawn ones; a sequence that sampled
        holds slots for exactly its computed tokens (the rest go back: ``truncate``), and the
        block manager knows what is computed (``mark_computed``); ``ScheduledSeq.num_accepted``
        is the number of draft tokens kept and appended; ``draft_ids`` are consumed.
    allocate_lookahead(seq, n) -> copies or None   slots for a drafter's n K/V writes past the
        computed tokens (``allocate_slots`` with lookahead); never preempts.
    add(seq), has_unfinished(), fork(parent, child), finish(seq), preempt(seq) (task 2): below.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int = 32, max_num_batched_tokens: int = 512):
        raise NotImplementedError("chapter 8, task 1")

    def add(self, seq: Sequence) -> None:
        raise NotImplementedError("chapter 8, task 1")

    def has_unfinished(self) -> bool:
        raise NotImplementedError("chapter 8, task 1")

    def schedule(self) -> SchedulerOutput:
        raise NotImplementedError("chapter 8, task 1")

    def update_from_output(self, plan: SchedulerOutput, output: RunnerOutput, emit: Emit) -> list:
        raise NotImplementedError("chapter 8, task 1")

    def allocate_lookahead(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]] | None:
        raise NotImplementedError("chapter 8, task 1")

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares the parent's blocks (``block_manager.fork``), starts computed as far as the
        parent, is RUNNING and joins the end of ``running``."""
        raise NotImplementedError("chapter 8, task 1")

    def preempt(self, seq: Sequence) -> None:
        """Task 2. Preemption by recompute: the sequence gives back all its KV blocks
        (``block_manager.free``), leaves ``running``, and waits at the *front* of ``waiting``
        (``appendleft``: it is older than every waiting request) with status WAITING,
        ``num_computed_tokens = 0`` and no draft: when it is admitted again, its prompt and the output so far are
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
