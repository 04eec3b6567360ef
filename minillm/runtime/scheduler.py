"""Continuous batching: which sequences run together in the next step, and what the step did.

The step has one owner per piece of state (the shape of vLLM v1's scheduler)::

    plan = scheduler.schedule()                           # who computes which tokens; KV slots for them
    output = runner.execute(plan)                         # one forward, then the tokens it chose
    outs = scheduler.update_from_output(plan, output, emit)   # append, accept drafts, finish, free

The scheduler is the only caller of the block manager's allocation (``allocate``,
``allocate_slots``, ``truncate``, ``fork``, ``free``). There are no phases: every running
sequence has ``num_tokens_with_spec - num_computed_tokens`` tokens to compute (a prompt's next
chunk, a decode token, a draft to verify, tokens a constraint forced), and a step gives each as
many as the limits allow.

Each step builds one batch under two limits - ``max_num_batched_tokens`` (the token budget of one
forward) and ``max_num_seqs`` (sequences running at once):

1. every running sequence with one token left to compute (its newest, plus its draft if it has
   one), oldest first, gets it: these are the streams, and they go first;
2. the other running sequences (a prompt's rest, tokens forced by a constraint), oldest first,
   get their next chunk (**chunked prefill**: a long prompt is spread over several steps, so the
   others keep decoding meanwhile);
3. waiting sequences are admitted first come, first served, while the budget, the sequence cap
   and the free KV blocks allow; their prefill may start with a chunk.

**Fairness** - short requests keep being admitted while long ones run: decode tokens go first
(step 1), so no prefill, however long, holds back a stream that is already running; and while
sequences wait, the chunks of step 2 leave ``max_num_batched_tokens // ADMISSION_SHARE`` tokens of
the budget to step 3. A short prompt that arrives while two full-context prompts are being
prefilled is therefore admitted at the next step where the sequence cap and the KV blocks allow
it, prefilled at once if it fits in that share, and then decodes one token every step: it
finishes within about ``max_tokens`` steps of its admission, however long the others are.
(Blocks are the other shared resource: the engine's default KV budget holds many full contexts.)
A draft is cut to the budget that is left, and dropped before anyone is preempted for it.

When a running sequence needs a block and none is free, the most recently admitted sequence is
**preempted by recompute**: its blocks are freed and it goes back to the front of the queue, to
recompute its prompt and output later (recomputing is cheaper than keeping swap space on a CPU).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from minillm.generation.sampling import TokenLogprobs
from minillm.runtime.block_manager import BlockManager
from minillm.runtime.sequence import Sequence, Status


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int  # tokens of this sequence computed in this step, its draft tokens included
    draft: list[int] = field(default_factory=list)       # the last len(draft) of them: guesses to verify
    forks: list[Sequence] = field(default_factory=list)  # n > 1: siblings that draw from this row too
    num_accepted: int = 0                                 # set by update_from_output: draft tokens kept
    samples: bool = field(init=False)  # the step computes the newest token: its logits choose the next one

    def __post_init__(self):
        self.samples = self.seq.num_computed_tokens + self.num_new - len(self.draft) == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks, before the forward
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)

    def sequences_in(self, seq_ids) -> list[Sequence]:
        """The step's sequences (forks included) whose ids are in ``seq_ids``, in batch order."""
        return [m for s in self.scheduled for m in (s.seq, *s.forks) if m.seq_id in seq_ids]


@dataclass
class RunnerOutput:
    """What the step's forward chose: per sequence that sampled (forks included), its tokens in order -
    one, or after a verify the kept draft tokens and the rule's own token (1 .. k + 1)."""
    token_ids: dict[int, list[int]]                                        # seq id -> tokens
    logprobs: dict[int, list[TokenLogprobs | None]] = field(default_factory=dict)  # seq id -> one per token
    errors: dict[int, str] = field(default_factory=dict)  # seq id -> why no token may continue it (it ends alone)


class Emitted(Protocol):
    finished: bool  # the token ended its sequence (eos, a stop, max_tokens, a full context)


# emit(seq, token_id, logprobs) -> an Emitted: the caller's record of a token appended to seq (the
# engine's StepOutput); its ``finished`` decides whether the sequence goes on.
Emit = Callable[[Sequence, int, "TokenLogprobs | None"], Emitted]

ADMISSION_SHARE = 8  # while sequences wait, running prefills leave them 1/8 of the token budget


def choose_victim(running: list[Sequence]) -> Sequence:
    """The sequence to preempt when one needs a KV block and none is free: the most recently admitted.

    ``running`` is in admission order. The oldest requests keep their progress (so every request
    finishes eventually), and the newest has usually computed the least, so recomputing it costs
    the least. It may be the very sequence that needs the block.
    """
    return running[-1]


class Scheduler:
    """A FCFS waiting queue, the running set (in admission order) and the block manager."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int = 32, max_num_batched_tokens: int = 512):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs ({max_num_seqs}) and max_num_batched_tokens "
                             f"({max_num_batched_tokens}) must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step: the plan ----------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # 1. the streams, oldest first: their newest token, and the draft after it while the budget lasts
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is Status.RUNNING and seq.num_uncomputed == 1:
                budget -= self._add(seq, min(1 + len(seq.draft_ids), budget), out)

        # 2. the next chunk of every other running sequence, oldest first; some budget stays for the waiting
        reserve = self.max_num_batched_tokens // ADMISSION_SHARE if self.waiting else 0
        for seq in list(self.running):
            if budget - reserve <= 0:
                break
            if seq.status is Status.RUNNING and seq.num_uncomputed > 1:
                budget -= self._add(seq, min(seq.num_uncomputed, budget - reserve), out)
        budget = self.max_num_batched_tokens - out.num_tokens  # a preemption may have given some back

        # 3. waiting sequences, first come first served (none while we are preempting)
        now = time.perf_counter()
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted
               and bm.can_allocate(self.waiting[0].seq_id, self.waiting[0].token_ids)):
            seq = self.waiting.popleft()
            seq.num_computed_tokens = bm.allocate(seq.seq_id, seq.token_ids)  # the cached prefix is skipped
            seq.status = Status.RUNNING
            seq.times.first_scheduled = seq.times.first_scheduled or now
            self.running.append(seq)
            num_new = min(seq.num_uncomputed, budget)
            out.scheduled.append(ScheduledSeq(seq, num_new, forks=self._forks(seq, num_new)))
            budget -= num_new
        return out

    def _add(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> int:
        """Schedule a running sequence's next ``num_new`` tokens, with their slots -> the tokens taken.

        Out of blocks, its draft goes first, then the newest running sequences are preempted
        until the slots fit; 0 if the sequence itself had to give way.
        """
        while (copies := self.block_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)) is None:
            if seq.draft_ids:
                seq.draft_ids, num_new = [], min(num_new, seq.num_uncomputed)
                continue
            victim = choose_victim(self.running)
            self.preempt(victim)
            out.preempted.append(victim)
            out.scheduled = [s for s in out.scheduled if s.seq is not victim]  # (its copies are harmless now)
            if victim is seq:
                return 0
        out.copies += copies
        draft = seq.draft_ids[:max(0, seq.num_computed_tokens + num_new - seq.num_tokens)]
        out.scheduled.append(ScheduledSeq(seq, num_new, draft, self._forks(seq, num_new)))
        return num_new

    @staticmethod
    def _forks(seq: Sequence, num_new: int) -> list[Sequence]:
        """The siblings that draw their first token from this step's row: when it ends the prompt."""
        return seq.forks if seq.forks and seq.num_computed_tokens + num_new == seq.num_tokens else []

    # ---- one step: what it did ---------------------------------------------------------

    def update_from_output(self, plan: SchedulerOutput, output: RunnerOutput, emit: Emit) -> list:
        """After the forward: append each sequence's tokens, keep or roll back its draft, apply the tokens
        its constraint forces, finish and free -> what ``emit`` returned for every token, in order.

        The scheduled tokens' K/V are in the cache now (full blocks become reusable by other
        prompts). A sequence that sampled ends the step holding slots for exactly its computed
        tokens: the slots of rejected draft tokens (and a drafter's unused lookahead) go back.
        ``emit`` is called after each token is appended; when it says ``finished`` the sequence's
        blocks are freed and no later token of it is appended.
        """
        bm, outputs, now = self.block_manager, [], time.perf_counter()
        for s in plan.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_new
            if not s.samples:                                      # mid-prompt: nothing to draw yet
                bm.mark_computed(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
                continue
            seq.times.prefill_done = seq.times.prefill_done or now
            for child in s.forks:
                self.fork(seq, child)
            seq.forks = [] if s.forks else seq.forks
            for member in (seq, *s.forks):
                if member.seq_id in output.errors:     # its constraint left no token: it ends, the batch goes on
                    self.finish(member)
                    continue
                tokens = output.token_ids[member.seq_id]
                logprobs = output.logprobs.get(member.seq_id) or [None] * len(tokens)
                outputs += self._append(member, s, tokens, logprobs, emit)
        return outputs

    def _append(self, seq: Sequence, s: ScheduledSeq, tokens: list[int], logprobs: list, emit: Emit) -> list:
        """One sampling sequence's tokens of this step: tokens[:-1] are kept draft tokens, the last is the
        rule's own; then the forced ones."""
        if seq is s.seq:
            seq.num_computed_tokens -= len(s.draft) - (len(tokens) - 1)   # rejected draft tokens: not computed
            seq.draft_ids = []
        # Its full blocks become reusable now, before a token may finish it and free them (a request of
        # max_tokens 1 would otherwise never lend its prompt to the next one); kept draft tokens are
        # not in token_ids yet, so their blocks are hashed at the end, if it goes on.
        self.block_manager.mark_computed(seq.seq_id, seq.token_ids, min(seq.num_computed_tokens, seq.num_tokens))
        outputs = []
        for token, lp in zip(tokens, logprobs):
            outputs.append(emitted := self._emit(seq, token, lp, emit))
            if emitted.finished:
                break
            s.num_accepted += seq is s.seq and len(outputs) < len(tokens)
        while not seq.finished and (forced := seq.forced_tokens()):    # jump-forward
            for token in forced:
                outputs.append(emitted := self._emit(seq, token, None, emit))
                if emitted.finished:
                    break
        if not seq.finished:
            bm = self.block_manager
            if bm.num_slots(seq.seq_id) > seq.num_computed_tokens:
                bm.truncate(seq.seq_id, seq.num_computed_tokens)
            bm.mark_computed(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        return outputs

    def _emit(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None, emit: Emit) -> Emitted:
        seq.append_token(token)
        emitted = emit(seq, token, logprobs)
        if emitted.finished:
            self.finish(seq)
        return emitted

    def allocate_lookahead(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]] | None:
        """Slots for a drafter that writes K/V after the computed tokens (early exit: the newest token,
        then its guesses but the last) -> the copy-on-write pairs to apply first, or None (no room: no
        draft). Never preempts anyone; the next ``update_from_output`` gives back what goes unused."""
        return self.block_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens, 0, num_tokens)

    # ---- state changes ---------------------------------------------------------------

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks; it waits at the front of the queue to recompute (its draft is dropped)."""
        self.block_manager.free(seq.seq_id)
        self.running.remove(seq)
        seq.status, seq.num_computed_tokens, seq.draft_ids = Status.WAITING, 0, []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares the parent's blocks (copy-on-write) and runs from where the parent is."""
        self.block_manager.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens, child.status = parent.num_computed_tokens, Status.RUNNING
        self.running.append(child)

    def finish(self, seq: Sequence) -> None:
        """A finished or aborted sequence leaves whatever state it is in and frees its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
