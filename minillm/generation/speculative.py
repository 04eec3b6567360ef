"""Speculative decoding's two halves that need no cache: drafters, and the rules that accept drafts.

A decode step streams every weight to produce one token per sequence; checking k guessed tokens in
the same forward costs little more while the step is memory-bound. So a cheap *drafter* guesses k
tokens, the target model scores all k + 1 positions at once, and an *acceptance rule* keeps the
longest prefix the target agrees with, plus one token of the target's own:

    context ... t        draft d0 d1 d2        target rows  r0 r1 r2 r3   (row j follows d_{j-1})
    greedy:   keep d_j while d_j == argmax r_j; then append argmax r_j (the correction, or a bonus)

Both rules here are *lossless*: greedy gives exactly the tokens greedy decoding gives, and the
rejection-sampling rule (Leviathan et al. 2023; Chen et al. 2023) draws every token from exactly
the target's distribution, whatever the drafter proposed.

The drafter interface is one method, small enough to write your own::

    class Drafter(Protocol):
        def propose(self, token_ids: Sequence[int], k: int) -> list[int]: ...   # at most k guesses
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from minillm.generation.sampling import Sampler, SamplingState, TokenLogprobs


class Drafter(Protocol):
    """Guesses the next tokens of a sequence from its token ids (prompt then output)."""

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """At most ``k`` guesses for the tokens after ``token_ids``; fewer (or none) when unsure."""
        ...


# -----------------------------------------------------------------------------------------------
# prompt lookup: the n-gram drafter


def ngram_propose(token_ids: Sequence[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Prompt-lookup decoding: the k tokens that followed the latest earlier occurrence of the last n.

    The longest n up to max_n that matches wins (a longer match is a better predictor), down to
    min_n; among occurrences of that length the latest wins: nearby text predicts best. The
    occurrence must end before the last token (the suffix trivially matches itself). Answers that
    quote their input (summaries, edits, code refactors, RAG) copy long spans, and every copied
    span is a run of right guesses.

    The search walks back over the earlier places of the last token, latest first, and counts how
    many tokens before each also match, stopping at the first full max_n match: a few list
    operations in C. The engine calls it for every drafting sequence in every step; a NumPy
    sliding-window comparison for each n took 17-44 us on 100-160-token sequences (and ~120 us
    inside an engine step, where the weights have pushed the interpreter out of the caches), this
    ~2 us (2-core Xeon VM).
    """
    if k < 1 or min_n < 1 or max_n < min_n:
        raise ValueError(f"need k >= 1 and 1 <= min_n <= max_n, got k={k}, min_n={min_n}, max_n={max_n}")
    ids = list(token_ids)
    back = ids[::-1]                            # back[j]: the token j places before the last
    best_n, best_end = 0, -1                    # the longest match so far, and where it ends (in back)
    end = 0
    while back and best_n < max_n:
        try:
            end = back.index(back[0], end + 1)  # the next earlier place of the last token
        except ValueError:
            break
        n = 1
        while n < max_n and end + n < len(back) and back[end + n] == back[n]:
            n += 1
        if n > best_n:                          # ties keep the later occurrence, found first
            best_n, best_end = n, end
    if best_n < min_n:
        return []
    follow = len(back) - best_end               # the index, in token_ids, of the token after the match
    return [int(t) for t in ids[follow:follow + k]]


class NgramDrafter:
    """``ngram_propose`` as a ``Drafter`` (vLLM's names: prompt_lookup_max / prompt_lookup_min)."""

    def __init__(self, prompt_lookup_max: int = 4, prompt_lookup_min: int = 1):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{prompt_lookup_min} and {prompt_lookup_max}")
        self.max_n, self.min_n = prompt_lookup_max, prompt_lookup_min

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        return ngram_propose(token_ids, k, self.max_n, self.min_n)


# -----------------------------------------------------------------------------------------------
# acceptance rules


def greedy_accept(draft: Sequence[int], target_argmax: Sequence[int]) -> list[int]:
    """The tokens greedy decoding would emit: the draft's longest prefix that matches, then the target's own.

    ``target_argmax`` (k + 1,) is the target's argmax at each verified row: row j saw the draft's
    first j tokens. The result has between 1 and k + 1 tokens; its last is always the target's.
    """
    if len(target_argmax) != len(draft) + 1:
        raise ValueError(f"{len(draft)} draft tokens need {len(draft) + 1} target rows, got {len(target_argmax)}")
    out = []
    for guess, truth in zip(draft, target_argmax):
        if guess != truth:
            break
        out.append(int(guess))
    out.append(int(target_argmax[len(out)]))                             # the correction, or the bonus token
    return out


def accept_probability(p: np.ndarray, q: np.ndarray, token: int) -> float:
    """min(1, p(x) / q(x)): the chance to keep draft token x drawn from q when the target says p."""
    if q[token] <= 0:
        raise ValueError(f"the draft proposed token {token}, to which its own distribution gives probability 0")
    return float(min(1.0, p[token] / q[token]))


def residual_distribution(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """After a rejection, draw from max(0, p - q), normalised -> (V,).

    Accepted mass plus this residual adds up to p exactly: P(x) = q(x) min(1, p/q) + (1 - beta)
    r(x) with beta = sum min(p, q), and (1 - beta) r(x) = max(0, p(x) - q(x)).
    """
    r = np.maximum(0.0, np.asarray(p, dtype=np.float64) - np.asarray(q, dtype=np.float64))  # (V,)
    total = r.sum()
    if total <= 0:  # p == q: a rejection has probability 0, so this cannot be asked for
        raise ValueError("p equals q, so no draft token can be rejected and there is no residual")
    return r / total


def sample_from(p: np.ndarray, rng: np.random.Generator) -> int:
    """One token from the probabilities p (V,), by inverting the CDF; a token of probability 0 never comes."""
    cdf = np.cumsum(p)                                                   # (V,)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(cdf) - 1))


def accept_or_resample(p: np.ndarray, q: np.ndarray, token: int, rng: np.random.Generator) -> tuple[int, bool]:
    """One verified row: keep draft ``token`` with probability min(1, p/q), else draw from the residual.

    Returns (the token emitted at this position, whether it is the draft's).
    """
    if rng.random() < accept_probability(p, q, token):
        return int(token), True
    return sample_from(residual_distribution(p, q), rng), False


def rejection_sample(draft: Sequence[int], q: np.ndarray, p: np.ndarray, rng: np.random.Generator) -> list[int]:
    """Speculative sampling: tokens distributed exactly as sampling from the target one by one.

    ``draft`` (k,) was drawn from the draft distributions ``q`` (k, V); ``p`` (k + 1, V) are the
    target's distributions at the k + 1 verified rows. Keep draft token j with probability
    min(1, p_j / q_j); at the first rejection draw from the residual and stop; if every draft token
    is kept, draw a bonus token from p_k. A deterministic drafter (n-gram, greedy draft) has q_j =
    one-hot(d_j): keep with probability p_j(d_j), else draw from p_j with d_j removed.
    """
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    if q.shape != (len(draft), p.shape[-1]) or p.shape[0] != len(draft) + 1:
        raise ValueError(f"{len(draft)} draft tokens need q ({len(draft)}, V) and p ({len(draft) + 1}, V); "
                         f"got q {q.shape} and p {p.shape}")
    out = []
    for j, token in enumerate(draft):
        emitted, accepted = accept_or_resample(p[j], q[j], token, rng)
        out.append(emitted)
        if not accepted:
            return out
    out.append(sample_from(p[-1], rng))                                  # every guess kept: a bonus token
    return out


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """E[tokens per verify step] when each draft token is accepted with probability alpha, independently.

    Token j + 1 is emitted when the first j are accepted: sum_{j=0..k} alpha^j = (1 - alpha^(k+1)) / (1 - alpha).
    """
    if not 0 <= alpha <= 1 or k < 0:
        raise ValueError(f"need 0 <= alpha <= 1 and k >= 0, got alpha={alpha}, k={k}")
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def verify_draft(sampler: Sampler, logits: np.ndarray, state: SamplingState, draft: Sequence[int]
                 ) -> tuple[list[int], list[TokenLogprobs | None], str | None]:
    """The tokens a draft's k + 1 verified rows (1 + k, V) decide, exactly as plain decoding would sample them.

    The acceptance rule judges the rows: ``greedy_accept`` on the target's argmax at each row when
    the request is greedy, else ``rejection_sample`` on the target's distributions with q one-hot
    (the drafters are deterministic). Both are looked up in this module when called, so that a
    rule set here (the course's seats) is the one the engine runs -> (1 .. k + 1 tokens, their
    logprobs, None). Row j is judged with the history plain decoding would have there - the
    output so far plus the draft's first j tokens, which row j is only reached by keeping - so
    penalties and min_tokens see exactly that; the sequence itself is not touched. A row where no
    token may follow (a constraint that min_tokens keeps from ending) and every row after it are
    left out: the rule judges the draft up to the row before it, whose token is then the rule's
    own; at the first row, ([], [], why) - the sequence cannot go on.
    """
    views = []
    for j in range(len(draft) + 1):
        view = copy.copy(state)                  # shares params and rng; its own history
        view.output_ids = state.output_ids + [int(t) for t in draft[:j]]
        if (stuck := sampler.stuck(logits[j:j + 1], view)) is not None:
            if not views:
                return [], [], stuck
            break
        views.append(view)
    # the n rows the rule judges (n, V): one per guess it may keep, then one for its own token
    rows, judged = logits[:len(views)], [int(t) for t in draft[:len(views) - 1]]
    if state.params.greedy:
        tokens = greedy_accept(judged, sampler.sample(rows, views).token_ids.tolist())
    else:
        p = sampler.probabilities(rows, views)                          # (n, V) the target's distributions
        q = np.zeros((len(judged), p.shape[1]))                         # (n - 1, V) one-hot: the drafter's
        q[np.arange(len(judged)), judged] = 1.0
        tokens = rejection_sample(judged, q, p, state.rng)
    tokens = _checked(tokens, judged, num_rows=len(views), vocab_size=logits.shape[1])
    return tokens, Sampler.logprobs(rows[:len(tokens)], np.array(tokens), [state.params] * len(tokens)), None


def _checked(tokens, draft: list[int], num_rows: int, vocab_size: int) -> list[int]:
    """The rule's answer as ints, once it has the shape the scheduler relies on: kept draft tokens,
    then one of the rule's own (the K/V of the rows after it are rolled back)."""
    tokens = [int(t) for t in tokens]
    if not 1 <= len(tokens) <= num_rows or tokens[:-1] != draft[:len(tokens) - 1]:
        raise ValueError(f"the acceptance rule returned {tokens} for the draft {draft}: it must return the draft's "
                         f"first m tokens (0 <= m <= {len(draft)}) and then one token of its own")
    if not all(0 <= t < vocab_size for t in tokens):
        raise ValueError(f"the acceptance rule returned {tokens}: outside the vocabulary of {vocab_size} tokens")
    return tokens
