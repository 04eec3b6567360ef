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

Drafting pays only while a step of k + 1 rows per sequence costs less than the tokens it emits
are worth. On a CPU one decode row is memory-bound (the weights are read once whatever the rows),
many rows are compute-bound: a verify that costs 2x a plain step and keeps 1.5 tokens on average
loses. So, unless the config fixes a rule (``disable_by_batch_size``), each step's drafts are cut
to the length whose step the engine's own measured step times (``StepCosts``) and each sequence's
measured acceptance by position expect to emit the most tokens per second - zero, no drafts, when
a plain step is best. See ``SpeculativeDecoder.paying_draft_length``.

Two drafters: ``"ngram"`` (prompt lookup, generation/speculative.py) and ``"self"`` - the model's
first ``num_draft_layers`` layers and its LM head (early exit), run through the model runner (so
every tensor-parallel rank runs them too), writing the K/V of those layers into lookahead slots
the scheduler gives, which the verify forward then overwrites with equal values: no second model,
no second cache.
"""
from __future__ import annotations

import bisect
import itertools
import statistics
import time
import weakref
from collections import deque
from dataclasses import dataclass, field, fields

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
    sequences than this, and below it every draft is verified whole. None (the default): the
    engine decides each step from its own measured step times and acceptance (the module's
    docstring) - a large batch has little spare arithmetic, so drafting stops by itself there, at
    the batch size where this machine and model stop paying for it, not at a constant.
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


PRIOR_WEIGHT = 4  # verifies' worth of the all-sequences acceptance in each sequence's estimate


@dataclass
class SeqRecord:
    disabled: bool = False
    drafted_at: list[int] = field(default_factory=list)   # (k,) verifies whose draft reached position i
    accepted_at: list[int] = field(default_factory=list)  # (k,) ... and kept it (and every one before it)

    def expected_accepted(self, length: int, prior: list[float]) -> list[float]:
        """Draft tokens a verify of this sequence's first c guesses is expected to keep, for c = 0
        .. ``length``: the sum over positions of the chance that every guess up to it is kept -
        this sequence's counts, with PRIOR_WEIGHT verifies' worth of ``prior`` (the chances over
        every sequence), so that a few verifies neither decide alone nor shut a position for good."""
        totals = [0.0]
        for i in range(length):
            kept, verified = (self.accepted_at[i], self.drafted_at[i]) if i < len(self.drafted_at) else (0, 0)
            totals.append(totals[-1] + (kept + PRIOR_WEIGHT * prior[i]) / (verified + PRIOR_WEIGHT))
        return totals


class StepCosts:
    """The engine's measured seconds for a decode step (schedule, forward, sampling, update), by the
    rows it computed: one per sequence plus its draft tokens - the median of a row count's last
    WINDOW steps. Between measured row counts the cost is interpolated linearly; above the largest
    it is extrapolated along the line through the smallest and the largest (a forward's arithmetic
    grows with its rows), and unknown (None) while fewer than two row counts are measured.

    A row count's first step may have compiled kernels for a new shape (seconds): it is kept only
    if it lies within a factor KEEP_FIRST of what the measured row counts predict for it. (Dropping
    every first step made each new row count cost a second exploring step, and a batch's verifies
    meet as many row counts as its drafts have lengths.)

    Rows alone key it: a step of 8 sequences and one of 1 sequence with 7 guesses count as one
    shape, though the first does a little more Python per sequence; the forward's cost dominates.
    The rule asks a dozen costs a step: each row count's median is kept, not recomputed.
    """
    WINDOW = 4
    KEEP_FIRST = 2.0

    def __init__(self):
        self.samples: dict[int, deque[float]] = {}
        self.medians: dict[int, float] = {}
        self.measured: list[int] = []  # the row counts in self.samples, sorted
        self.first_dropped: set[int] = set()

    def record(self, rows: int, seconds: float) -> None:
        if rows not in self.samples:
            expected = self.seconds(rows)
            in_line = expected is not None and expected / self.KEEP_FIRST <= seconds <= expected * self.KEEP_FIRST
            if not in_line and rows not in self.first_dropped:
                self.first_dropped.add(rows)
                return
            self.samples[rows] = deque(maxlen=self.WINDOW)
            bisect.insort(self.measured, rows)
        self.samples[rows].append(seconds)
        self.medians[rows] = statistics.median(self.samples[rows])

    def seconds(self, rows: int) -> float | None:
        if rows in self.medians:
            return self.medians[rows]
        above = bisect.bisect(self.measured, rows)  # the first measured row count above ``rows``
        if 0 < above < len(self.measured):
            lo, hi = self.measured[above - 1], self.measured[above]
        elif above >= 2:
            lo, hi = self.measured[0], self.measured[-1]
        else:
            return None
        t_lo, t_hi = self.medians[lo], self.medians[hi]
        return t_hi + max(t_hi - t_lo, 0.0) * (rows - hi) / (hi - lo)

    def spread(self, rows: int) -> float:
        """Slowest over fastest of the row count's kept steps: 1.0 for a row count not measured."""
        kept = self.samples.get(rows)
        return max(kept) / min(kept) if kept else 1.0


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
        self.costs = StepCosts()
        self.drafted_at = [0] * config.num_speculative_tokens  # (k,) verifies, all sequences, whose draft reached position i
        self.draft_seconds_per_token = 0.0  # "self": the early-exit drafting, measured (ngram's lookup: ~0)

    def propose(self, plan: SchedulerOutput, scheduler: Scheduler, runner: ModelRunner, step_seconds: float) -> None:
        """Count the drafts ``plan`` verified and time its step, then give the running sequences
        drafts for the next step.

        The drafts together stay within the next step's token budget (after one token per running
        sequence); none while more sequences than ``disable_by_batch_size`` run or wait, since the
        next step may schedule all of them; without that rule, cut to ``paying_draft_length``.
        """
        for s in plan.scheduled:
            if s.draft:
                self._count(s.seq, len(s.draft), s.num_accepted)
        if plan.scheduled and all(s.num_new == 1 + len(s.draft) for s in plan.scheduled):  # a decode step
            self.costs.record(plan.num_tokens, step_seconds)
        limit = self.config.disable_by_batch_size
        if limit is not None and len(scheduler.running) + len(scheduler.waiting) > limit:
            return
        budget, candidates = scheduler.max_num_batched_tokens - len(scheduler.running), []
        for seq in scheduler.running:
            k = min(self._room(seq), budget)
            if k > 0:
                candidates.append((seq, k))
                budget -= k
        batch = len(scheduler.running)
        keep = self.paying_draft_length(batch, candidates) if limit is None else self.config.num_speculative_tokens
        if keep == 0:
            return  # not even every sequence drafting at its longest would pay: no lookups, no early exits
        if self.config.method == "ngram":
            drafts = [self.ngram.propose(seq.token_ids, k) for seq, k in candidates]
            if limit is None:  # the lookups may find shorter drafts, or none: weigh those
                keep = self.paying_draft_length(batch, [(seq, len(d)) for (seq, _), d in zip(candidates, drafts)])
            for (seq, _), draft in zip(candidates, drafts):
                seq.draft_ids = draft[:keep]
            return
        candidates = [(seq, min(k, keep)) for seq, k in candidates]
        copies, seqs, ks = [], [], []
        for seq, k in candidates:   # early exit writes K/V for the newest token and k - 1 guesses
            if (more := scheduler.allocate_lookahead(seq, k)) is not None:
                copies += more
                seqs.append(seq)
                ks.append(k)
        if not seqs:
            return
        start = time.perf_counter()
        for seq, draft in zip(seqs, runner.draft(seqs, ks, copies, self.config.num_draft_layers)):
            seq.draft_ids = draft
        self.draft_seconds_per_token = (time.perf_counter() - start) / sum(ks)

    def paying_draft_length(self, batch: int, drafts: list[tuple[Sequence, int]]) -> int:
        """How many draft tokens each sequence brings to the next step (0 .. k): the length at which
        that step is expected to emit the most tokens per second.

        A step of ``batch`` sequences whose drafts are cut to c tokens computes rows(c) = batch +
        sum(min(d, c)) rows and emits batch + the expected kept guesses (each sequence's measured
        acceptance by position, ``SeqRecord.expected_accepted``, leaning on every sequence's at
        first); its seconds are the measured step cost at rows(c) (``StepCosts``) plus the
        drafting. A length must beat the plain step by more than the spread of the plain step's
        timings (``StepCosts.spread``). A shape not yet measured is measured first: a plain step of
        this batch, then one with a single guess a sequence - the cheapest verify, and the one that
        risks least where rows are dear; longer drafts are then weighed on the line through the
        two. (Exploring with whole drafts cost most exactly where they do not pay: at 8 streams in
        int8 mode a step of 40 rows took ~3.8x the plain one, and 16 rows ~2x - scratch, 2-core
        AMD EPYC Zen 5 VM.)
        """
        longest = max((d for _, d in drafts), default=0)
        plain = self.costs.seconds(batch)
        if longest == 0 or plain is None:
            return 0
        if self.costs.seconds(batch + sum(min(d, 1) for _, d in drafts)) is None:
            return 1  # only this batch's plain step is measured yet
        # the chance that a draft is kept up to each position, over every sequence: 1 before any verify, so that
        # the first drafts are tried, but never above the position before it (a guess counts only if every one
        # before it was kept), so that a position never tried is taken to be as good as the last tried, not
        # certain - an optimism that sent whole drafts to 8-stream int8 steps, at 2-4x a plain step's cost
        prior = list(itertools.accumulate(((kept + 1) / (verified + 1) for kept, verified
                                           in zip(self.stats.accepted_per_pos, self.drafted_at)), min))
        kept_by_cut = [self.records.setdefault(seq, SeqRecord()).expected_accepted(d, prior) for seq, d in drafts]
        # a gain within the spread of the plain step's own timings is noise: on a shared machine step times move
        # in phases, and a draft taken on a verify timed in a faster one costs up to 2-4x a plain step
        best, best_rate = 0, batch / plain * self.costs.spread(batch)
        for c in range(1, longest + 1):
            guesses = sum(min(d, c) for _, d in drafts)
            kept = sum(by_cut[min(d, c)] for by_cut, (_, d) in zip(kept_by_cut, drafts))
            seconds = self.costs.seconds(batch + guesses) + self.draft_seconds_per_token * guesses
            if (batch + kept) / seconds > best_rate:
                best, best_rate = c, (batch + kept) / seconds
        return best

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
        for pos in range(drafted):
            self.drafted_at[pos] += 1
        rec = self.records.setdefault(seq, SeqRecord())
        if not rec.drafted_at:
            rec.drafted_at, rec.accepted_at = [0] * self.config.num_speculative_tokens, [0] * self.config.num_speculative_tokens
        for pos in range(drafted):
            rec.drafted_at[pos] += 1
            rec.accepted_at[pos] += pos < accepted
        verifies = rec.drafted_at[0]  # every draft reaches position 0
        if verifies >= self.config.min_drafts and sum(rec.accepted_at) < self.config.min_acceptance_rate * sum(rec.drafted_at):
            rec.disabled = True
