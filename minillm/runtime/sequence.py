"""A request's sequence and its state machine.

    WAITING --admitted--> RUNNING --eos / stop / length--> FINISHED
       ^                     |
       +----preempted--------+      (its blocks are freed; it will recompute everything)

A request with ``n`` completions is ``n`` sequences. The first is prefilled; the others fork its
blocks once the prompt is in the cache (copy-on-write) instead of computing the prompt again.

A sequence is token ids, sampling parameters and cache state only: turning its tokens into text
and deciding that it is done belongs to the engine's output builders, so the scheduler runs (and
is tested) without a tokenizer.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from minillm.generation.constrained import Guide
from minillm.generation.sampling import SamplingParams, SamplingState


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SequenceTimes:
    """Wall-clock instants (time.perf_counter) of a sequence's life.

    Its time to first token is queue (arrival -> first_scheduled), prefill (-> prefill_done: the
    forward that made its first token's logits has ended) and first sample (-> first_token).
    """
    arrival: float
    first_scheduled: float | None = None
    prefill_done: float | None = None
    first_token: float | None = None
    tokens: list[float] = field(default_factory=list)
    finished: float | None = None


class Sequence:
    """Prompt and output ids, the sampler's state, where it stands in the cache, and its timings."""

    def __init__(self, seq_id: int, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 choice: int = 0, arrival: float | None = None, guide: Guide | None = None):
        self.seq_id, self.request_id, self.choice = seq_id, request_id, choice
        self.prompt_ids = prompt_ids
        self.params = params
        self.output_ids: list[int] = []
        self.sampler_state = SamplingState(params, prompt_ids, self.output_ids, choice=choice, guide=guide)
        self.status = Status.WAITING
        self.num_computed = 0       # leading tokens whose K/V are in the cache
        self.num_preemptions = 0
        self.times = SequenceTimes(arrival=time.perf_counter() if arrival is None else arrival)

    def append_token(self, token_id: int) -> None:
        """A new token was drawn (or forced by the constraint): the next step must run it through the model."""
        self.output_ids.append(token_id)
        if self.sampler_state.guide is not None:
            self.sampler_state.guide.advance(token_id)

    @property
    def token_ids(self) -> list[int]:
        """Prompt then output: what the cache must hold, the newest sampled token last."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model: the prompt (or its rest), or the newest token."""
        return self.num_tokens - self.num_computed

    @property
    def is_prefill(self) -> bool:
        return self.num_uncomputed > 1 or not self.output_ids

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, {self.status.value}, prompt {len(self.prompt_ids)}, "
                f"output {len(self.output_ids)}, computed {self.num_computed})")
