"""Drafters and acceptance rules against brute force, and rejection sampling against exact probabilities.

Exercise tests (chapter 10 tasks 1-3) grade ngram_propose, greedy_accept and rejection_sample through
the ``impl`` fixture: the package by default, exercises/ch10_speculative.py with --impl=exercises.
"""
import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm.generation.speculative import (NgramDrafter, expected_tokens_per_step, ngram_propose,
                                            residual_distribution)
from minillm.runtime.speculative import SpeculativeConfig


def brute_force_lookup(ids, k, max_n, min_n):
    """The oracle: try n from max_n down; the latest earlier window equal to the last n tokens."""
    T = len(ids)
    for n in range(max_n, min_n - 1, -1):
        if n >= T:
            continue
        for start in range(T - n - 1, -1, -1):      # latest first; the suffix itself (start T - n) excluded
            if list(ids[start:start + n]) == list(ids[T - n:]):
                return list(ids[start + n:start + n + k])
    return []


@pytest.mark.ch10_ngram_drafter
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 3), min_size=1, max_size=40), k=st.integers(1, 6),
       min_n=st.integers(1, 3), extra=st.integers(0, 3))
def test_ngram_lookup_equals_brute_force(impl, ids, k, min_n, extra):
    max_n = min_n + extra
    p = impl("ch10_speculative")
    assert p.ngram_propose(ids, k, max_n, min_n) == brute_force_lookup(ids, k, max_n, min_n)
    assert NgramDrafter(max_n, min_n).propose(ids, k) == brute_force_lookup(ids, k, max_n, min_n)


@pytest.mark.ch10_ngram_drafter
def test_ngram_lookup_copies_the_span_after_the_latest_match(impl):
    p = impl("ch10_speculative")
    #          0  1  2  3  4  5  6  7  8  9
    ids = [7, 1, 2, 9, 9, 1, 2, 5, 6, 1, 2]
    assert p.ngram_propose(ids, 3, max_n=2, min_n=1) == [5, 6, 1]   # "1 2" last seen at 5..6
    assert p.ngram_propose([1, 2, 3], 2) == []                      # nothing repeats
    with pytest.raises(ValueError):
        p.ngram_propose([1, 2], 0)


def test_bad_drafter_arguments_are_named():
    with pytest.raises(ValueError, match="k >= 1"):
        ngram_propose([1, 2], 0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramDrafter(prompt_lookup_max=1, prompt_lookup_min=2)


@pytest.mark.ch10_greedy_accept
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(draft=st.lists(st.integers(0, 2), max_size=6), data=st.data())
def test_greedy_accept_equals_decoding_one_token_at_a_time(impl, draft, data):
    target = data.draw(st.lists(st.integers(0, 2), min_size=len(draft) + 1, max_size=len(draft) + 1))
    # one at a time: emit the target's token; go on only while it is the one the draft guessed
    expected = []
    for j in range(len(draft) + 1):
        expected.append(target[j])
        if j == len(draft) or target[j] != draft[j]:
            break
    assert impl("ch10_speculative").greedy_accept(draft, target) == expected


@pytest.mark.ch10_greedy_accept
def test_greedy_accept_needs_one_row_more_than_the_draft(impl):
    with pytest.raises(ValueError):
        impl("ch10_speculative").greedy_accept([1, 2, 3], [1, 2, 3])


def test_residual_plus_accepted_mass_is_the_target():
    rng = np.random.default_rng(0)
    p, q = rng.dirichlet(np.ones(6)), rng.dirichlet(np.ones(6))
    accepted = q * np.minimum(1, p / q)                              # draw x ~ q, keep it
    rejected = 1 - accepted.sum()
    np.testing.assert_allclose(accepted + rejected * residual_distribution(p, q), p, atol=1e-12)
    with pytest.raises(ValueError, match="no residual"):
        residual_distribution(p, p)


def chi_square_critical(df: int, z: float = 3.29) -> float:
    """Upper quantile of chi-square(df) at the standard-normal z (3.29: p = 0.0005), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.ch10_rejection_sampling
@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_rejection_sampling_draws_strings_with_the_targets_probabilities(impl, deterministic_draft):
    """A target and a draft Markov chain over 3 tokens; speculate k = 2 at a time until 3 tokens are out.

    The chi-square test compares the 27 three-token strings against their exact probability
    under the target chain alone. A deterministic draft (argmax of its chain, q one-hot) is
    the n-gram and early-exit drafters' case.
    """
    rng = np.random.default_rng(1)
    V, k, length, trials = 3, 2, 3, 20000
    P = rng.dirichlet(np.ones(V) * 0.7, size=V)                     # (V, V) target: next | previous
    Q = rng.dirichlet(np.ones(V) * 0.7, size=V)                     # (V, V) draft
    start = 0
    counts = np.zeros((V,) * length)
    for _ in range(trials):
        out, prev = [], start
        while len(out) < length:
            draft, q, ctx = [], [], prev
            for _ in range(k):
                dist = np.eye(V)[np.argmax(Q[ctx])] if deterministic_draft else Q[ctx]
                token = int(rng.choice(V, p=dist))
                draft.append(token)
                q.append(dist)
                ctx = token
            contexts = [prev, *draft]                                # row j follows draft[:j]
            emitted = impl("ch10_speculative").rejection_sample(draft, np.array(q), P[contexts], rng)
            out += emitted
            prev = out[-1]
        counts[tuple(out[:length])] += 1
    exact = np.array([P[start, a] * P[a, b] * P[b, c] for a, b, c in itertools.product(range(V), repeat=3)])
    observed = counts.reshape(-1)
    chi2 = ((observed - trials * exact) ** 2 / (trials * exact)).sum()
    assert chi2 < chi_square_critical(exact.size - 1), chi2


def test_expected_tokens_per_step_is_the_geometric_sum():
    for alpha, k in [(0.0, 4), (0.5, 1), (0.8, 4), (1.0, 3)]:
        # brute force: enumerate accept/reject outcomes of the k draft tokens
        total = 0.0
        for outcome in itertools.product([True, False], repeat=k):
            prob = math.prod(alpha if a else 1 - alpha for a in outcome)
            accepted = next((i for i, a in enumerate(outcome) if not a), k)
            total += prob * (accepted + 1)
        assert expected_tokens_per_step(alpha, k) == pytest.approx(total)


def test_speculative_config_names_what_is_wrong():
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3}).num_speculative_tokens == 3
    with pytest.raises(ValueError, match="unknown speculative option"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "model": "x"})
    with pytest.raises(ValueError, match="needs 'num_speculative_tokens'"):
        SpeculativeConfig.from_dict({"method": "ngram"})
    with pytest.raises(ValueError, match="method must be one of"):
        SpeculativeConfig.from_dict({"method": "medusa", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="num_draft_layers"):
        SpeculativeConfig.from_dict({"method": "self", "num_speculative_tokens": 3})


# -----------------------------------------------------------------------------------------------
# verify_draft judges the rows through the rule set in generation/speculative.py (the course's seats)

def verify_with_rule(monkeypatch, name, rule, temperature):
    """verify_draft on a 3-token draft over a vocabulary of 6, with `rule` at generation.speculative.`name`."""
    import minillm.generation.speculative as speculative
    from minillm.generation.sampling import Sampler, SamplingParams, SamplingState

    monkeypatch.setattr(speculative, name, rule)
    logits = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)   # (1 + k, V)
    state = SamplingState(SamplingParams(temperature=temperature, seed=0))
    return speculative.verify_draft(Sampler(), logits, state, [1, 2, 3]), logits


@pytest.mark.parametrize("name, temperature", [("greedy_accept", 0.0), ("rejection_sample", 1.0)])
def test_verify_draft_asks_the_rule_set_in_its_module(monkeypatch, name, temperature):
    seen = []

    def rule(draft, *rows):
        seen.append((list(draft), [np.shape(r) for r in rows[:2]]))
        return [*draft[:1], 5]       # keeps d0, then its own token

    (tokens, logprobs, error), logits = verify_with_rule(monkeypatch, name, rule, temperature)
    assert tokens == [1, 5] and error is None and len(logprobs) == 2
    expected_rows = [(4,)] if name == "greedy_accept" else [(3, 6), (4, 6)]   # argmax per row; q and p
    assert seen == [([1, 2, 3], expected_rows)]


@pytest.mark.parametrize("answer", [[], [2, 5], [1, 2, 3, 4, 5], [1, 99]])
def test_verify_draft_refuses_a_rule_answer_the_scheduler_cannot_keep(monkeypatch, answer):
    with pytest.raises(ValueError, match="acceptance rule returned"):
        verify_with_rule(monkeypatch, "greedy_accept", lambda draft, target: answer, 0.0)
