"""A request's sequence and its state machine.

    WAITING --admitted--> RUNNING --eos / stop / length--> FINISHED
       ^                     |
       +----preempted--------+      (its blocks are freed; it will recompute everything)

A request with ``n`` completions is ``n`` sequences. The first is prefilled; the others (its
``forks``) share its blocks once the prompt is in the cache (copy-on-write) instead of computing
the prompt again.

There are no phases. A sequence has ``num_tokens`` tokens (prompt, then output), of which the
first ``num_computed_tokens`` have their K/V in the cache, and perhaps ``draft_ids``: guesses of
a drafter that the next step verifies. Each step computes some of the rest:

    num_tokens_with_spec - num_computed_tokens      tokens to compute
      a prompt (or its rest, in chunks)             many, nothing to sample until the last ran
      decode                                        1: the newest sampled token
      verify                                        1 + len(draft_ids)
      jump-forward                                  1 + the tokens a constraint forced after it

Forced tokens (``forced_tokens``) are appended to the output as soon as they are known, like
sampled ones, and are then simply tokens still to compute.

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
                 choice: int = 0, arrival: float | None = None, guide: Guide | None = None,
                 jump_forward: bool = False):
        """``jump_forward``: append the tokens ``guide`` forces without a forward each (never with
        logprobs, which forced tokens do not have)."""
        self.seq_id, self.request_id, self.choice = seq_id, request_id, choice
        self.prompt_ids = prompt_ids
        self.params = params
        self.output_ids: list[int] = []
        self.sampler_state = SamplingState(params, prompt_ids, self.output_ids, choice=choice, guide=guide)
        self.status = Status.WAITING
        self.num_computed_tokens = 0        # leading tokens whose K/V are in the cache
        self.draft_ids: list[int] = []      # a drafter's guesses after the newest token, verified next step
        self.forks: list[Sequence] = []     # n > 1: the request's other sequences, forked when the prompt ran
        self.jump_forward = jump_forward and guide is not None and params.logprobs is None
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
    def newest_token_id(self) -> int:
        """token_ids[-1], without copying the list."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """The tokens the next step would compute up to: every token, then the draft."""
        return len(self.prompt_ids) + len(self.output_ids) + len(self.draft_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens (drafts aside) whose K/V are not in the cache yet: a prompt's rest, the newest, forced ones."""
        return self.num_tokens - self.num_computed_tokens

    def forced_tokens(self) -> list[int]:
        """The tokens the constraint forces now (jump-forward, SGLang's compressed FSM); [] when the model chooses.

        Once the text is complete the constraint forces EOS, which ends the sequence - unless the
        request wants no end here (``ignore_eos``, or ``min_tokens`` not reached yet).
        """
        if not self.jump_forward:
            return []
        guide, p = self.sampler_state.guide, self.params
        if self.output_ids and self.output_ids[-1] == guide.index.eos_id:
            return []                                    # it has ended already
        forced = guide.forced_tokens()
        if forced == [guide.index.eos_id] and (p.ignore_eos or len(self.output_ids) < p.min_tokens):
            return []
        return forced

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, {self.status.value}, prompt {len(self.prompt_ids)}, "
                f"output {len(self.output_ids)}, computed {self.num_computed_tokens}, draft {len(self.draft_ids)})")
