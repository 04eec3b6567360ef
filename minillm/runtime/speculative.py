"""Speculative decoding in the engine: drafts proposed after each step, verified in the next one.

    step N    schedule -> execute -> update_from_output -> propose (this module): draft_ids for step N + 1
    step N+1  a sequence with a draft d0..d(k-1) computes k + 1 tokens: its newest token t, then the draft
                  rows     t   d0  d1  d2           (the scheduler gives them slots, like any tokens)
                  logits   r0  r1  r2  r3           row j decides the token after t, d0, .., d(j-1)
              the runner judges the rows exactly as plain decoding would sample them
              (generation/speculative.py: verify_draft); update_from_output appends the kept tokens
              and gives back the slots of the rejected ones

Every token goes through the engine's usual output builder (detokenizer, stop strings, max_tokens,
EOS, logprobs), one at a time, so speculation changes how many tokens a step emits, never which.
Speculative and plain sequences share one step: the batch is flat, and ``query_lens`` already lets
a sequence bring several rows.

Two drafters: ``"ngram"`` (prompt lookup, generation/speculative.py) and ``"self"`` - the model's
first ``num_draft_layers`` layers and its LM head (early exit), run through the model runner (so
every tensor-parallel rank runs them too), writing the K/V of those layers into lookahead slots
the scheduler gives, which the verify forward then overwrites with equal values: no second model,
no second cache.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, fields

from minillm.generation.speculative import NgramDrafter
from minillm.runtime.model_runner import ModelRunner
from minillm.runtime.scheduler import Scheduler, SchedulerOutput
from minillm.runtime.sequence import Sequence

METHODS = ("ngram", "self")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` keys, for the drafters minillm has.

    ``min_acceptance_rate``: after ``min_drafts`` verify steps with a draft, a sequence whose
    draft tokens were accepted less often than this stops drafting - wrong guesses cost rows.

    ``disable_by_batch_size`` (vLLM's name): no sequence drafts in a step that schedules more
    sequences than this. A large batch has little spare arithmetic, and its k + 1 rows per
    sequence also move every sequence of the step from the decode attention kernel to the
    prefill one; measured on a 2-core CPU, 16 sequences decoded slower with drafts than without.
    None: speculate at any batch size.
    """
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4          # ngram
    prompt_lookup_min: int = 2          # ngram
    num_draft_layers: int | None = None  # self: the early-exit depth
    min_acceptance_rate: float = 0.2
    min_drafts: int = 8
    disable_by_batch_size: int | None = None

    @classmethod
    def from_dict(cls, options: dict) -> SpeculativeConfig:
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(options) - known):
            raise ValueError(f"unknown speculative option(s) {unknown}; known: {sorted(known)}")
        for name in ("method", "num_speculative_tokens"):
            if name not in options:
                raise ValueError(f"speculative config needs {name!r}, e.g. "
                                 f"{{'method': 'ngram', 'num_speculative_tokens': 4}}")
        return cls(**options)

    def __post_init__(self):
        """Each field checked by itself, in order, so that the message names the one that is wrong
        (a string where a number belongs must not surface as a TypeError from a comparison)."""
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} "
                             f"and {self.prompt_lookup_max}")
        if self.method == "self" and self.num_draft_layers is None:
            raise ValueError("method 'self' needs num_draft_layers >= 1, got None")
        if self.num_draft_layers is not None:
            _check_int("num_draft_layers", self.num_draft_layers, 1)
        if self.disable_by_batch_size is not None and not (_is_int(self.disable_by_batch_size)
                                                           and self.disable_by_batch_size >= 1):
            raise ValueError(f"disable_by_batch_size must be an integer >= 1 or None, "
                             f"got {self.disable_by_batch_size!r}")
        rate = self.min_acceptance_rate
        if not (isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 <= rate <= 1):
            raise ValueError(f"min_acceptance_rate must be a number in [0, 1], got {rate!r}")
        _check_int("min_drafts", self.min_drafts, 0)


# A draft of k tokens reserves k lookahead KV slots per sequence and k + 1 verify rows in every
# step, whether or not they are accepted; with acceptance rate a, the expected tokens per step
# (1 - a^(k+1)) / (1 - a) gain little past k ~ 8 even at a = 0.8 (4.89 tokens at k = 16 against
# 4.33 at k = 8, at twice the rows). 16 leaves room to measure that tail; 1000 would make every
# decode step a 1,001-row prefill and hold a thousand slots per sequence.
MAX_SPECULATIVE_TOKENS = 16


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int to Python, not to a config


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    if not (_is_int(value) and low <= value and (high is None or value <= high)):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {bounds}, got {value!r}")


@dataclass
class SpecStats:
    """Cumulative counters under vLLM's spec_decode_* names."""
    num_drafts: int = 0               # verify steps that carried a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] | None = None  # (k,) accepted draft tokens at each draft position


@dataclass
class SeqRecord:
    drafts: int = 0
    drafted: int = 0
    accepted: int = 0
    disabled: bool = False


class SpeculativeDecoder:
    """Proposes drafts for the running sequences after each step, and counts how the last ones fared."""

    def __init__(self, config: SpeculativeConfig, num_layers: int, max_model_len: int):
        if config.method == "self" and config.num_draft_layers >= num_layers:
            raise ValueError(f"num_draft_layers ({config.num_draft_layers}) must be below the model's "
                             f"{num_layers} layers")
        self.config, self.max_model_len = config, max_model_len
        self.ngram = NgramDrafter(config.prompt_lookup_max, config.prompt_lookup_min)
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        # weak keys: a sequence's record goes when the engine lets the sequence go
        self.records: weakref.WeakKeyDictionary[Sequence, SeqRecord] = weakref.WeakKeyDictionary()

    def propose(self, plan: SchedulerOutput, scheduler: Scheduler, runner: ModelRunner) -> None:
        """Count the drafts ``plan`` verified, then give the running sequences drafts for the next step.

        The drafts together stay within the next step's token budget (after one token per running
        sequence); none while more sequences than ``disable_by_batch_size`` run or wait, since the
        next step may schedule all of them.
        """
        for s in plan.scheduled:
            if s.draft:
                self._count(s.seq, len(s.draft), s.num_accepted)
        limit = self.config.disable_by_batch_size
        if limit is not None and len(scheduler.running) + len(scheduler.waiting) > limit:
            return
        budget, candidates = scheduler.max_num_batched_tokens - len(scheduler.running), []
        for seq in scheduler.running:
            k = min(self._room(seq), budget)
            if k > 0:
                candidates.append((seq, k))
                budget -= k
        if self.config.method == "ngram":
            for seq, k in candidates:
                seq.draft_ids = self.ngram.propose(seq.token_ids, k)
            return
        copies, seqs, ks = [], [], []
        for seq, k in candidates:   # early exit writes K/V for the newest token and k - 1 guesses
            if (more := scheduler.allocate_lookahead(seq, k)) is not None:
                copies += more
                seqs.append(seq)
                ks.append(k)
        for seq, draft in zip(seqs, runner.draft(seqs, ks, copies, self.config.num_draft_layers) if seqs else []):
            seq.draft_ids = draft

    def _room(self, seq: Sequence) -> int:
        """Draft tokens this sequence may take: 0 unless its next step is a plain decode that may speculate."""
        p = seq.params
        if seq.num_uncomputed != 1 or not seq.output_ids or seq.draft_ids or seq.sampler_state.guide is not None:
            return 0
        if self.records.setdefault(seq, SeqRecord()).disabled:
            return 0
        k = self.config.num_speculative_tokens
        if p.max_tokens is not None:           # a verify emits up to k + 1 tokens: never past max_tokens
            k = min(k, p.max_tokens - len(seq.output_ids) - 1)
        return min(k, self.max_model_len - seq.num_tokens)  # draft positions stay inside the context

    def _count(self, seq: Sequence, drafted: int, accepted: int) -> None:
        st = self.stats
        st.num_drafts += 1
        st.num_draft_tokens += drafted
        st.num_accepted_tokens += accepted
        for pos in range(accepted):
            st.accepted_per_pos[pos] += 1
        rec = self.records.setdefault(seq, SeqRecord())
        rec.drafts, rec.drafted, rec.accepted = rec.drafts + 1, rec.drafted + drafted, rec.accepted + accepted
        if rec.drafts >= self.config.min_drafts and rec.accepted < self.config.min_acceptance_rate * rec.drafted:
            rec.disabled = True
