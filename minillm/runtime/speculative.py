"""Speculative decoding in the engine: draft after scheduling, verify in the one forward, roll back.

    step   schedule -> draft (this module) -> one forward over every row -> verify (this module)
    a decode sequence with a draft d0..d(k-1) runs k + 1 rows: its newest token t, then the draft
           rows     t   d0  d1  d2           (slots for the draft: BlockManager.append_lookahead_slots)
           logits   r0  r1  r2  r3           row j decides the token after t, d0, .., d(j-1)
    verify  row by row, exactly as plain decoding would sample: keep d_j while the rule accepts it,
            then emit the rule's own token and stop; rejected draft slots are truncated away.

Every token goes through the engine's usual ``_append`` (detokenizer, stop strings, max_tokens,
EOS, logprobs), one at a time, so speculation changes how many tokens a step emits, never which.
Speculative and plain sequences share one step: the batch is flat, and ``query_lens`` already lets
a sequence bring several rows.

Two drafters: ``"ngram"`` (prompt lookup, generation/speculative.py) and ``"self"`` - the model's
first ``num_draft_layers`` layers and its LM head (early exit), writing the K/V of those layers
into the very slots the verify forward then overwrites with equal values: no second model, no
second cache.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np

from minillm.generation.sampling import Sampler
from minillm.generation.speculative import NgramDrafter, accept_or_resample, sample_from
from minillm.model.transformer import Model
from minillm.runtime.block_manager import BlockManager
from minillm.runtime.paged_cache import PagedAttentionMetadata, PagedKVCache
from minillm.runtime.scheduler import ScheduledSeq, SchedulerOutput
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
    """Drafts for the decode sequences of a step, verifies them, rolls back, counts."""

    def __init__(self, config: SpeculativeConfig, model: Model, cache: PagedKVCache, block_manager: BlockManager,
                 sampler: Sampler, max_model_len: int):
        if config.method == "self" and config.num_draft_layers >= model.config.n_layers:
            raise ValueError(f"num_draft_layers ({config.num_draft_layers}) must be below the model's "
                             f"{model.config.n_layers} layers")
        self.config, self.model, self.cache, self.bm = config, model, cache, block_manager
        self.sampler, self.max_model_len = sampler, max_model_len
        self.ngram = NgramDrafter(config.prompt_lookup_max, config.prompt_lookup_min)
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        # weak keys: a sequence's record goes when the engine lets the sequence go
        self.records: weakref.WeakKeyDictionary[Sequence, SeqRecord] = weakref.WeakKeyDictionary()

    # ---- drafting -------------------------------------------------------------------

    def draft(self, plan: SchedulerOutput, budget: int) -> None:
        """Give drafts to the step's decode sequences while ``budget`` (batch tokens left) and blocks allow."""
        limit = self.config.disable_by_batch_size
        if limit is not None and len(plan.scheduled) > limit:
            return
        candidates = []
        for s in plan.scheduled:
            k = min(self._room(s), budget)
            if k > 0:
                candidates.append((s, k))
                budget -= k
        if self.config.method == "ngram":
            for s, k in candidates:
                self._reserve(s, self.ngram.propose(s.seq.token_ids, k), plan)
        else:
            self._draft_early_exit([(s, k) for s, k in candidates if self.bm.can_append_slots(s.seq.seq_id, k)], plan)

    def _room(self, s: ScheduledSeq) -> int:
        """Draft tokens this sequence may take: 0 unless it is a plain decode step that may speculate."""
        seq, p = s.seq, s.seq.params
        if not (s.num_new == 1 and s.completes_prefill and seq.output_ids) or seq.sampler_state.guide is not None:
            return 0
        if self.records.setdefault(seq, SeqRecord()).disabled:
            return 0
        k = self.config.num_speculative_tokens
        if p.max_tokens is not None:           # a verify emits up to k + 1 tokens: never past max_tokens
            k = min(k, p.max_tokens - len(seq.output_ids) - 1)
        return min(k, self.max_model_len - seq.num_tokens)  # draft positions stay inside the context

    def _reserve(self, s: ScheduledSeq, draft: list[int], plan: SchedulerOutput) -> None:
        if not draft or not self.bm.can_append_slots(s.seq.seq_id, len(draft)):
            return
        if (copy := self.bm.append_lookahead_slots(s.seq.seq_id, len(draft))) is not None:
            plan.copies.append(copy)
        s.draft = draft

    def _draft_early_exit(self, candidates: list[tuple[ScheduledSeq, int]], plan: SchedulerOutput) -> None:
        """k greedy early-exit forwards, batched over the sequences: each runs the previous guess."""
        if not candidates:
            return
        for s, k in candidates:
            if (copy := self.bm.append_lookahead_slots(s.seq.seq_id, k)) is not None:
                plan.copies.append(copy)
        for src, dst in plan.copies:            # the draft reads those blocks before the runner would copy them
            self.cache.copy_block(src, dst)     # (the runner copies again: harmless, src is unchanged)
        drafts: list[list[int]] = [[] for _ in candidates]
        for step in range(max(k for _, k in candidates)):
            active = [i for i, (_, k) in enumerate(candidates) if len(drafts[i]) < k]
            seqs = [candidates[i][0].seq for i in active]
            tokens = np.array([drafts[i][-1] if drafts[i] else seq.token_ids[-1] for i, seq in zip(active, seqs)])
            meta = PagedAttentionMetadata.build(
                [1] * len(active), [seq.num_computed + step for seq in seqs],
                [self.bm.block_table(seq.seq_id) for seq in seqs], self.bm.block_size)
            logits = self.model.forward(tokens, meta, self.cache, num_layers=self.config.num_draft_layers)
            guesses = np.argmax(logits, axis=-1)                         # (len(active),)
            for i, guess in zip(active, guesses):
                drafts[i].append(int(guess))
        for (s, _), draft in zip(candidates, drafts):
            s.draft = draft

    # ---- verifying ------------------------------------------------------------------

    def verify(self, s: ScheduledSeq, logits: np.ndarray, append: Callable, now: float) -> list:
        """Emit the tokens rows ``logits`` (1 + k, V) decide, roll the cache back to them; -> StepOutputs.

        ``append(seq, token, logprobs, now)`` is the engine's: each token is appended before the
        next row is judged, so penalties, min_tokens and stop checks see exactly what plain
        decoding would have shown them. Runs after ``Scheduler.mark_computed`` counted the
        newest token as computed.
        """
        seq, draft, state = s.seq, s.draft, s.seq.sampler_state
        computed = seq.num_computed            # the newest token's K/V are in; the draft's are written too
        outputs, accepted = [], 0
        for j in range(len(draft) + 1):
            guess = draft[j] if j < len(draft) else None
            token, logprobs = self._decide(logits[j:j + 1], state, guess)
            outputs.append(append(seq, token, logprobs, now))
            if seq.finished or token != guess:
                break
            accepted += 1
        self._count(seq, len(draft), accepted)
        if not seq.finished:                   # finished: its blocks are freed already
            seq.num_computed = computed + accepted
            self.bm.truncate(seq.seq_id, seq.num_computed)
            self.bm.mark_computed(seq.seq_id, seq.token_ids, seq.num_computed)
        return outputs

    def _decide(self, row: np.ndarray, state, guess: int | None):
        """The token at one verified row (1, V), with its logprobs: as plain decoding samples it."""
        if state.params.greedy:                # greedy acceptance: keep the guess iff it is the argmax
            drawn = self.sampler.sample(row, [state])
            return int(drawn.token_ids[0]), drawn.logprobs[0]
        p = self.sampler.probabilities(row, [state])[0]                 # (V,) the target's distribution
        if guess is None:
            token = sample_from(p, state.rng)                            # the bonus row: a plain draw
        else:                                  # a deterministic drafter: q is one-hot on the guess
            q = np.zeros_like(p)
            q[guess] = 1.0
            token, _ = accept_or_resample(p, q, guess, state.rng)
        logprobs = Sampler.logprobs(row, np.array([token]), [state.params])[0]
        return token, logprobs

    def _count(self, seq: Sequence, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
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
