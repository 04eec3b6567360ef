"""Sampling against hand computations and Hugging Face's logits warpers (the oracle for each filter).

transformers' TopK/TopP/MinP/Temperature warpers and RepetitionPenaltyLogitsProcessor define the
same filters as vLLM; presence and frequency penalties (not in transformers) are checked by hand.
"""
import math

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from minillm.generation.sampling import (SamplingParams, SamplingState, Sampler, apply_penalties, min_p_filter,
                                         top_k_filter)


def hf(warper, logits: np.ndarray, input_ids=None) -> np.ndarray:
    """Apply a transformers logits processor to one (V,) row of float64 logits."""
    ids = torch.tensor([input_ids if input_ids is not None else []], dtype=torch.long)
    return warper(ids, torch.tensor(logits[None], dtype=torch.float64))[0].numpy()


def kept(logits: np.ndarray) -> list[int]:
    return np.flatnonzero(np.isfinite(logits)).tolist()


def sample_once(logits, **params) -> int:
    state = SamplingState(SamplingParams(**params))
    return int(Sampler().sample(np.asarray(logits, dtype=np.float32)[None], [state]).token_ids[0])


# -----------------------------------------------------------------------------------------------
# Greedy

def test_temperature_zero_is_argmax_with_ties_to_the_lowest_id():
    assert sample_once([1.0, 5.0, 5.0, 2.0], temperature=0.0) == 1
    assert sample_once([7.0, 7.0, 7.0], temperature=0.0, top_k=1, top_p=0.1) == 0
    logits = np.random.default_rng(0).normal(size=(8, 1000)).astype(np.float32)
    states = [SamplingState(SamplingParams(temperature=0.0)) for _ in range(8)]
    np.testing.assert_array_equal(Sampler().sample(logits, states).token_ids, logits.argmax(axis=1))


def test_greedy_fast_path_picks_what_the_full_pipeline_picks_ties_included():
    """Plain greedy rows take the argmax fast path; logprobs=0 sends the same rows through the
    general pipeline. Both must choose the lowest id among the tied maxima (found here by hand)."""
    rng = np.random.default_rng(4)
    logits = rng.integers(-3, 4, size=(16, 50)).astype(np.float32)  # small integers: ties everywhere
    logits[3] = 2.0                                                   # a row that is all one tie
    logits[5, :10] = -np.inf                                          # masked tokens
    expected = [min(i for i, v in enumerate(row) if v == row.max()) for row in logits]
    fast = Sampler().sample(logits, [SamplingState(SamplingParams(temperature=0.0)) for _ in range(16)])
    full = Sampler().sample(logits, [SamplingState(SamplingParams(temperature=0.0, logprobs=0)) for _ in range(16)])
    np.testing.assert_array_equal(fast.token_ids, expected)
    np.testing.assert_array_equal(full.token_ids, expected)
    assert fast.logprobs == [None] * 16 and all(lp is not None for lp in full.logprobs)


def test_greedy_with_min_tokens_still_masks_eos():
    """min_tokens changes the logits, so such a greedy row must not take the argmax shortcut."""
    logits = np.array([[0.0, 9.0, 1.0]], dtype=np.float32)            # eos (id 1) is the argmax
    state = SamplingState(SamplingParams(temperature=0.0, min_tokens=1))
    assert Sampler(eos_token_ids=[1]).sample(logits, [state]).token_ids[0] == 2
    state.output_ids.append(2)                                        # min_tokens reached: eos allowed
    assert Sampler(eos_token_ids=[1]).sample(logits, [state]).token_ids[0] == 1


# -----------------------------------------------------------------------------------------------
# Filters

def test_top_k_keeps_ties_with_the_kth_logit():
    logits = np.array([[3.0, 1.0, 3.0, 2.0, 3.0], [3.0, 1.0, 3.0, 2.0, 3.0]])
    out = top_k_filter(logits, np.array([2, 4]))
    assert kept(out[0]) == [0, 2, 4]           # three tied for first: k = 2 cannot split them
    assert kept(out[1]) == [0, 2, 3, 4]
    np.testing.assert_array_equal(out[1, [0, 2, 3, 4]], [3.0, 3.0, 2.0, 3.0])


@pytest.mark.parametrize("k", [0, -1, 1, 7, 100, 1000])
def test_top_k_matches_transformers(k):
    logits = np.random.default_rng(k + 5).normal(size=(3, 100))
    out = top_k_filter(logits, np.full(3, k))
    for row in range(3):
        expected = logits[row] if k <= 0 else hf(TopKLogitsWarper(top_k=k), logits[row])
        np.testing.assert_array_equal(out[row], expected)


@pytest.mark.ch06_top_p
def test_top_p_keeps_the_token_that_crosses_p(impl):
    g = impl("ch06_generation")
    probs = np.array([0.125, 0.5, 0.125, 0.25])      # sorted: 1 (0.5), 3 (0.25), then 0 and 2 (0.125)
    logits = np.log(probs)
    assert kept(g.top_p_filter(logits, 0.01)) == [1]          # the most likely token always stays
    assert kept(g.top_p_filter(logits, 0.49)) == [1]
    assert kept(g.top_p_filter(logits, 0.51)) == [1, 3]       # 0.5 < p: token 3 crosses it and stays
    assert kept(g.top_p_filter(logits, 0.74)) == [1, 3]
    assert kept(g.top_p_filter(logits, 0.76)) == [0, 1, 3]    # of the tied 0 and 2, one is enough
    assert kept(g.top_p_filter(logits, 0.99)) == [0, 1, 2, 3]
    assert kept(g.top_p_filter(logits, 1.0)) == [0, 1, 2, 3]
    out = g.top_p_filter(logits, 0.51)
    np.testing.assert_allclose(out[[1, 3]], logits[[1, 3]])   # kept logits are unchanged


@pytest.mark.ch06_top_p
def test_top_p_batched_with_one_p_per_row(impl):
    g = impl("ch06_generation")
    logits = np.log(np.array([[0.125, 0.5, 0.125, 0.25], [0.7, 0.1, 0.1, 0.1]]))
    out = g.top_p_filter(logits, np.array([0.6, 0.75]))
    assert out.shape == (2, 4)
    assert kept(out[0]) == [1, 3] and kept(out[1]) == [0, 1]
    assert [kept(r) for r in g.top_p_filter(logits, 0.6)] == [[1, 3], [0]]


@pytest.mark.ch06_top_p
@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.8, 0.95, 0.999])
def test_top_p_matches_transformers(impl, top_p):
    g = impl("ch06_generation")
    logits = np.random.default_rng(int(top_p * 1000)).normal(scale=2.0, size=(4, 200))
    out = g.top_p_filter(logits, top_p)
    for row in range(4):
        assert kept(out[row]) == kept(hf(TopPLogitsWarper(top_p=top_p), logits[row]))


@pytest.mark.ch06_top_p
@pytest.mark.parametrize("scale, top_p", [(0.05, 0.9), (3.0, 0.95), (0.5, 0.5)])
def test_top_p_on_a_real_size_vocabulary_matches_transformers(impl, scale, top_p):
    """49152 tokens: a flat distribution (the nucleus holds thousands of tokens), a peaked one, between."""
    g = impl("ch06_generation")
    logits = np.random.default_rng(int(scale * 100)).normal(scale=scale, size=(2, 49152))
    out = g.top_p_filter(logits, top_p)
    for row in range(2):
        assert kept(out[row]) == kept(hf(TopPLogitsWarper(top_p=top_p), logits[row]))


def test_min_p_keeps_tokens_at_least_min_p_times_the_top():
    probs = np.array([[0.5, 0.3, 0.15, 0.05]])
    assert kept(min_p_filter(np.log(probs), np.array([0.2]))[0]) == [0, 1, 2]   # threshold 0.1
    assert kept(min_p_filter(np.log(probs), np.array([0.5]))[0]) == [0, 1]      # threshold 0.25
    assert kept(min_p_filter(np.log(probs), np.array([1.0]))[0]) == [0]


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.3, 0.9])
def test_min_p_matches_transformers(min_p):
    logits = np.random.default_rng(7).normal(scale=2.0, size=(3, 300))
    out = min_p_filter(logits, np.full(3, min_p))
    for row in range(3):
        assert kept(out[row]) == kept(hf(MinPLogitsWarper(min_p=min_p), logits[row]))


# -----------------------------------------------------------------------------------------------
# Penalties

LOGITS = np.array([[2.0, -1.0, 0.5, 3.0, -2.0]])
PROMPT, OUTPUT = [0, 1], [3, 3, 4]


@pytest.mark.parametrize("presence, frequency, repetition, expected", [
    # repetition 2 over prompt + output {0, 1, 3, 4}: positive / 2, negative * 2; token 2 unseen
    (0.0, 0.0, 2.0, [1.0, -2.0, 0.5, 1.5, -4.0]),
    # frequency 0.5 x count in the output: token 3 twice, token 4 once
    (0.0, 0.5, 1.0, [2.0, -1.0, 0.5, 2.0, -2.5]),
    # presence 0.3 once per distinct output token (3 and 4), prompt tokens untouched
    (0.3, 0.0, 1.0, [2.0, -1.0, 0.5, 2.7, -2.3]),
    # all three: repetition first, then frequency and presence
    (0.3, 0.5, 2.0, [1.0, -2.0, 0.5, 0.2, -4.8]),
    # negative penalties reward repeats
    (-0.3, -0.5, 1.0, [2.0, -1.0, 0.5, 4.3, -1.2]),
])
def test_penalties_by_hand(presence, frequency, repetition, expected):
    out = apply_penalties(LOGITS, [PROMPT], [OUTPUT], np.array([presence]), np.array([frequency]),
                          np.array([repetition]))
    np.testing.assert_allclose(out[0], expected, atol=1e-12)


def test_penalties_steer_the_greedy_choice():
    # token 3 leads by 1.0; repeated twice with frequency 0.6 it drops below token 0
    assert sample_once(LOGITS[0], temperature=0.0) == 3
    state = SamplingState(SamplingParams(temperature=0.0, frequency_penalty=0.6), prompt_ids=PROMPT,
                          output_ids=list(OUTPUT))
    assert Sampler().sample(LOGITS.astype(np.float32), [state]).token_ids[0] == 0


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    logits = np.random.default_rng(3).normal(size=(1, 50))
    prompt, output = [1, 5, 5, 9, 40], [9, 12, 3]
    out = apply_penalties(logits, [prompt], [output], np.zeros(1), np.zeros(1), np.array([penalty]))
    np.testing.assert_allclose(out[0], hf(RepetitionPenaltyLogitsProcessor(penalty), logits[0], prompt + output))


# -----------------------------------------------------------------------------------------------
# min_tokens, logprobs

def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = np.array([[0.0, 1.0, 5.0, 4.0, 3.0]], dtype=np.float32)   # eos 2 is the argmax, then 3
    sampler = Sampler(eos_token_ids=[2])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])

    def pick(output_ids, p=params):
        return int(sampler.sample(logits, [SamplingState(p, output_ids=output_ids)]).token_ids[0])
    assert pick([]) == 4 and pick([7]) == 4          # eos and the stop id are masked
    assert pick([7, 7]) == 2                         # min_tokens reached: eos is allowed again
    ignoring = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert pick([], ignoring) == 2                   # ignore_eos: eos never ends the request, nothing to mask


def test_logprobs_are_the_raw_log_softmax():
    logits = np.random.default_rng(11).normal(size=(2, 64)).astype(np.float32)
    states = [SamplingState(SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.5, logprobs=5, seed=1),
                            prompt_ids=[0, 1, 2]),
              SamplingState(SamplingParams(temperature=0.0, logprobs=0))]
    result = Sampler().sample(logits, states)
    reference = torch.log_softmax(torch.tensor(logits, dtype=torch.float64), dim=-1).numpy()
    for row in range(2):
        lp = result.logprobs[row]
        token = int(result.token_ids[row])
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(reference[row, token], abs=1e-9)
        assert lp.rank == 1 + int((reference[row] > reference[row, token]).sum())
        top = np.argsort(-reference[row], kind="stable")[:states[row].params.logprobs]
        assert lp.top_ids == top.tolist()
        np.testing.assert_allclose(lp.top_logprobs, reference[row, top], atol=1e-9)
    assert Sampler().sample(logits[:1], [SamplingState(SamplingParams())]).logprobs == [None]


# -----------------------------------------------------------------------------------------------
# Randomness: seeds, the distribution, batches

def test_same_seed_same_tokens_and_different_seed_different_tokens():
    logits = np.random.default_rng(2).normal(size=(1, 1000)).astype(np.float32)

    def run(seed):
        state = SamplingState(SamplingParams(seed=seed, temperature=1.2, presence_penalty=0.5))
        for _ in range(40):
            state.output_ids.append(int(Sampler().sample(logits, [state]).token_ids[0]))
        return state.output_ids
    assert run(123) == run(123)
    assert run(123) != run(124)


# chi-square critical values at significance 0.001, by degrees of freedom (standard tables)
CHI2_CRITICAL_0_001 = {3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458}


def test_draws_follow_the_filtered_distribution():
    logits = np.random.default_rng(5).normal(scale=1.5, size=12)
    params = dict(temperature=0.8, min_p=0.02, top_k=8, top_p=0.9)
    # the oracle: transformers' warpers in vLLM's order, then softmax
    expected = logits
    for warper in (TemperatureLogitsWarper(0.8), MinPLogitsWarper(0.02), TopKLogitsWarper(8), TopPLogitsWarper(0.9)):
        expected = hf(warper, expected)
    expected = torch.softmax(torch.tensor(expected), dim=-1).numpy()
    support = np.flatnonzero(expected > 0)
    assert 4 <= len(support) <= 7  # the filters bite: some tokens are out

    draws = 6000
    state = SamplingState(SamplingParams(seed=0, **params))
    tokens = [int(Sampler().sample(logits[None].astype(np.float32), [state]).token_ids[0]) for _ in range(draws)]
    counts = np.bincount(tokens, minlength=12)
    assert counts[expected == 0].sum() == 0  # filtered tokens are never drawn
    chi2 = (((counts[support] - draws * expected[support]) ** 2) / (draws * expected[support])).sum()
    assert chi2 < CHI2_CRITICAL_0_001[len(support) - 1], (chi2, counts, expected)


def make_states():
    """A mixed batch: greedy, plain, every filter, penalties, min_tokens, logprobs; all seeded."""
    return [
        SamplingState(SamplingParams(temperature=0.0, logprobs=2), prompt_ids=[1, 2]),
        SamplingState(SamplingParams(seed=1), prompt_ids=[3]),
        SamplingState(SamplingParams(seed=2, temperature=0.7, top_k=20), prompt_ids=[4, 5]),
        SamplingState(SamplingParams(seed=3, top_p=0.8, min_p=0.05, logprobs=3), prompt_ids=[6]),
        SamplingState(SamplingParams(seed=4, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
                      prompt_ids=[7, 8, 9]),
        SamplingState(SamplingParams(seed=5, min_tokens=3, stop_token_ids=[10], temperature=1.5), prompt_ids=[0]),
    ]


def test_a_batch_samples_like_one_row_at_a_time():
    rng = np.random.default_rng(9)
    steps = [rng.normal(size=(6, 300)).astype(np.float32) for _ in range(5)]
    sampler = Sampler(eos_token_ids=[11])
    batched, single = make_states(), make_states()
    for logits in steps:
        together = sampler.sample(logits, batched)
        alone = [sampler.sample(logits[row:row + 1], [single[row]]) for row in range(6)]
        np.testing.assert_array_equal(together.token_ids, [r.token_ids[0] for r in alone])
        assert together.logprobs == [r.logprobs[0] for r in alone]
        for states, ids in ((batched, together.token_ids), (single, together.token_ids)):
            for state, token in zip(states, ids):
                state.output_ids.append(int(token))


def test_logits_must_have_one_row_per_state():
    with pytest.raises(ValueError, match="one row per state"):
        Sampler().sample(np.zeros((2, 5), dtype=np.float32), [SamplingState(SamplingParams())])


# -----------------------------------------------------------------------------------------------
# SamplingParams

def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.seed, p.stop, p.stop_token_ids, p.ignore_eos) == (None, [], [], False)
    assert (p.max_tokens, p.min_tokens, p.logprobs) == (16, 0, None)


def test_edge_values_are_accepted_and_stop_is_normalised():
    p = SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0,
                       repetition_penalty=0.01, max_tokens=1, min_tokens=1, logprobs=0, stop="###", seed=-7)
    assert p.stop == ["###"] and p.greedy
    assert SamplingParams(max_tokens=None, min_tokens=5).max_tokens is None


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 1.5),
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5),
    ("top_k", -2), ("top_k", 2.5),
    ("min_p", -0.01), ("min_p", 1.5),
    ("presence_penalty", 2.5), ("presence_penalty", -2.1),
    ("frequency_penalty", 3.0), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("seed", 1.5), ("seed", "42"),
    ("stop", ""), ("stop", ["ok", ""]), ("stop", [1]),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["2"]), ("stop_token_ids", 5),
    ("ignore_eos", "yes"),
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("logprobs", -1), ("logprobs", 1.5),
])
def test_out_of_range_parameters_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)
