"""Continuous batching: which sequences run together in the next step.

Each step builds one batch under two limits - ``max_num_batched_tokens`` (the token budget of one
forward) and ``max_num_seqs`` (sequences running at once):

1. every running sequence that is decoding, oldest first, gets its one next token;
2. running sequences in the middle of a prompt, oldest first, get its next chunk (**chunked
   prefill**: a long prompt is spread over several steps, so the others keep decoding meanwhile);
3. waiting sequences are admitted first come, first served, while the budget, the sequence cap
   and the free KV blocks allow; their prefill may start with a chunk.

**Fairness** - short requests keep being admitted while long ones run: decode tokens go first
(step 1), so no prefill, however long, holds back a stream that is already running; and while
sequences wait, the prefill chunks of step 2 leave ``max_num_batched_tokens // ADMISSION_SHARE``
tokens of the budget to step 3. A short prompt that arrives while two full-context prompts are
being prefilled is therefore admitted at the next step where the sequence cap and the KV blocks
allow it, prefilled at once if it fits in that share, and then decodes one token every step: it
finishes within about ``max_tokens`` steps of its admission, however long the others are.
(Blocks are the other shared resource: the engine's default KV budget holds many full contexts.)

When a running sequence needs a block and none is free, the most recently admitted sequence is
**preempted by recompute**: its blocks are freed and it goes back to the front of the queue, to
recompute its prompt and output later (recomputing is cheaper than keeping swap space on a CPU).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minillm.runtime.block_manager import BlockManager
from minillm.runtime.sequence import Sequence, Status


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int  # tokens of this sequence that run in this step
    draft: list[int] = field(default_factory=list)  # speculative tokens verified after them (runtime/speculative.py)

    @property
    def completes_prefill(self) -> bool:
        """Whether this step computes the sequence's last token: its logits pick the next token."""
        return self.seq.num_computed + self.num_new == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)


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

    # ---- one step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # 1. running sequences that decode, oldest first: the newest token of each needs a slot
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            i += 1
            if bm.num_slots(seq.seq_id) >= seq.num_tokens:  # mid-prompt: step 2
                continue
            while not bm.can_append(seq.seq_id):
                victim = choose_victim(self.running)
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break  # it preempted itself: everyone after it is gone too
            _, copy = bm.append_slot(seq.seq_id, seq.token_ids)
            if copy is not None:
                out.copies.append(copy)
            out.scheduled.append(ScheduledSeq(seq, 1))
            budget -= 1

        # 2. the next chunk of each running prompt, oldest first; some budget stays for the waiting
        reserve = self.max_num_batched_tokens // ADMISSION_SHARE if self.waiting else 0
        decoding = {id(s.seq) for s in out.scheduled}
        for seq in self.running:
            if budget - reserve <= 0:
                break
            if id(seq) not in decoding and bm.num_slots(seq.seq_id) >= seq.num_tokens:
                num_new = min(seq.num_uncomputed, budget - reserve)
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new

        # 3. waiting sequences, first come first served (none while we are preempting)
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted
               and bm.can_allocate(self.waiting[0].seq_id, self.waiting[0].token_ids)):
            seq = self.waiting.popleft()
            seq.num_computed = bm.allocate(seq.seq_id, seq.token_ids)  # the cached prefix is skipped
            seq.status = Status.RUNNING
            self.running.append(seq)
            num_new = min(seq.num_uncomputed, budget)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return out

    def mark_computed(self, scheduled: list[ScheduledSeq]) -> None:
        """After the forward: the scheduled tokens' K/V are in the cache."""
        for s in scheduled:
            s.seq.num_computed += s.num_new
            self.block_manager.mark_computed(s.seq.seq_id, s.seq.token_ids, s.seq.num_computed)

    # ---- state changes ---------------------------------------------------------------

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks; it waits at the front of the queue to recompute."""
        self.block_manager.free(seq.seq_id)
        self.running.remove(seq)
        seq.status, seq.num_computed = Status.WAITING, 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares the parent's blocks (copy-on-write) and runs from where the parent is."""
        self.block_manager.fork(parent.seq_id, child.seq_id)
        child.num_computed, child.status = parent.num_computed, Status.RUNNING
        self.running.append(child)

    def finish(self, seq: Sequence) -> None:
        """A finished or aborted sequence leaves whatever state it is in and frees its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
