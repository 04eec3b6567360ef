"""The compiled sampling kernels (minillm/kernels/cpu/sampling.py) against their specification, the
NumPy pipeline of generation/sampling.py (itself checked against transformers' warpers in
test_sampling.py), and directly against transformers' warpers on a real-size vocabulary.

- filter_rows: the same kept tokens and the same values as temperature -> min_p_filter ->
  top_k_filter -> top_p_filter, on every kind of row (ties, flat rows, tiny and real vocabularies,
  mixed parameters in one batch);
- sample_rows: the token ``draw`` picks from the NumPy-filtered logits at the same uniform;
- Sampler with seeds: the tokens of the NumPy pipeline with the same seeds (one uniform per row,
  drawn in the same order: the compiled path changes no RNG call);
- the candidates' scan: the ids np.flatnonzero finds, for peaked and flat rows, on any chunk;
- apply_penalties: bit for bit the NumPy function;
- exp_nonpositive (the kernel's vectorisable exp): within 1 ulp of np.exp on a dense sweep of
  [-745, 0], and 0 exactly where np.exp is subnormal.
"""
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from minillm.generation import sampling as spec
from minillm.generation.sampling import Sampler, SamplingParams, SamplingState
from minillm.kernels.cpu import sampling as compiled


def numpy_filtered(x, temperature, min_p, top_k, top_p):
    """The specification, row by row: x (R, V) -> (R, V) float64."""
    out = np.asarray(x, dtype=np.float64) / np.asarray(temperature, dtype=np.float64)[:, None]
    for r in range(out.shape[0]):
        row = out[r:r + 1]
        if min_p[r] > 0:
            row = spec.min_p_filter(row, min_p[r:r + 1])
        if top_k[r] > 0:
            row = spec.top_k_filter(row, top_k[r:r + 1])
        if top_p[r] < 1:
            row = spec.top_p_filter(row, top_p[r:r + 1])
        out[r] = row[0]
    return out


def random_case(rng, V: int, B: int, ties: bool):
    x = rng.standard_normal((B, V)) * rng.uniform(0.1, 8)
    if ties:
        x = np.round(x)
    temperature = rng.uniform(0.2, 2.0, B)
    min_p = rng.choice([0.0, 0.0, 0.01, 0.3], B)
    top_k = rng.choice([-1, 0, 1, 2, 7, 50, V - 1, V, V + 3], B)
    top_p = rng.choice([1.0, 0.3, 0.8, 0.95, 0.999], B)
    return x, temperature, min_p, top_k, top_p


@pytest.mark.parametrize("V", [1, 4, 97, 2000, 49152])
@pytest.mark.parametrize("ties", [False, True])
def test_filter_rows_keep_what_the_numpy_filters_keep(V, ties):
    rng = np.random.default_rng(V + ties)
    for _ in range(30 if V < 49152 else 6):
        x, *params = random_case(rng, V, 4, ties)
        np.testing.assert_array_equal(compiled.filter_rows(x, *params), numpy_filtered(x, *params))


def test_flat_rows_and_rows_far_apart():
    """All logits equal (one histogram bin holds them all: ties to the lower id decide), and
    logits spread over hundreds of nats (most tokens in the last bin)."""
    V = 1000
    flat = np.zeros((1, V))
    spread = np.linspace(0, -800, V)[None, ::-1].copy()
    for x in (flat, spread):
        for p in (0.001, 0.25, 0.5, 0.999):
            for k in (0, 3, 999):
                args = (np.ones(1), np.zeros(1), np.array([k]), np.array([p]))
                np.testing.assert_array_equal(compiled.filter_rows(x, *args), numpy_filtered(x, *args))


def test_flat_rows_with_thousands_of_tokens_in_the_nucleus():
    """Rows like a random-token prompt's on SmolLM2 (V = 49152, the nucleus at top_p 0.95 holds
    thousands of tokens): the candidates then span many fine bins, and the cut bin is ranked alone."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((4, 49152)) * np.array([1.0, 1.5, 2.0, 2.5])[:, None]).astype(np.float32)
    temperature, min_p = np.full(4, 0.8), np.zeros(4)
    for top_k, top_p in ((0, 0.95), (0, 0.5), (0, 0.999), (3000, 0.95), (20000, 1.0)):
        args = (temperature, min_p, np.full(4, top_k), np.full(4, top_p))
        want = numpy_filtered(x, *args)
        if top_p == 0.95 and top_k == 0:
            assert (np.isfinite(want).sum(axis=1) > 1000).all()  # the case this test is about
        np.testing.assert_array_equal(compiled.filter_rows(x, *args), want)
        for u in rng.random((5, 4)):
            np.testing.assert_array_equal(compiled.sample_rows(x, *args, u), spec.draw(want, u))


def test_top_k_on_peaked_rows_where_fewer_than_k_tokens_lie_within_10_nats():
    """Rows like SmolLM2's at T = 0.8 under top_k = 50: a few tokens near the top, the k-th tens of
    nats below it - the candidates are then bounded by the wider count (WIDE_DISTANCES), or, past
    its last distance, are every live token."""
    rng = np.random.default_rng(11)
    V = 49152
    x = rng.uniform(-300.0, -12.0, (4, V))         # everything else far below the top
    x[:, :5] = [0.0, -0.5, -1.0, -3.0, -9.0]          # the peak: 5 tokens within 10 nats
    x[1] = np.round(x[1] / 4) * 4                   # ties across the cut
    x[3, 5:] = rng.uniform(-400.0, -200.0, V - 5)   # the 50th token beyond the widest distance
    e = x - x.max(axis=1, keepdims=True)
    assert ((e >= -10).sum(axis=1) < 50).all() and ((e >= -110).sum(axis=1) >= 50)[:3].all()
    assert ((e >= -110).sum(axis=1) < 50)[3]
    for top_k, top_p, min_p in ((50, 1.0, 0.0), (50, 0.95, 0.0), (1000, 0.999999, 0.0), (50, 1.0, 1e-30)):
        args = (np.ones(4), np.full(4, min_p), np.full(4, top_k), np.full(4, top_p))
        want = numpy_filtered(x, *args)
        np.testing.assert_array_equal(compiled.filter_rows(x, *args), want)
        for u in rng.random((5, 4)):
            np.testing.assert_array_equal(compiled.sample_rows(x, *args, u), spec.draw(want, u))


def test_exp_is_within_one_ulp_of_numpys():
    d = np.concatenate([np.linspace(-745.0, 0.0, 4_000_001), -rng_uniform_ln2(), [0.0, -0.0, -1e-300]])
    got = np.empty_like(d)
    compiled.exp_rows(d, got)
    want = np.exp(d)
    normal = want >= 2.0 ** -1022
    ulps = np.abs(got[normal].view(np.int64) - want[normal].view(np.int64))
    assert ulps.max() <= 1
    assert (got[~normal] == 0).all() and (~normal).any()
    assert got[-3] == got[-2] == 1.0
    out = np.empty(1)
    compiled.exp_rows(np.array([-np.inf]), out)
    assert out[0] == 0.0


def rng_uniform_ln2():
    """Reduced arguments |r| <= ln 2 / 2 (where the polynomial alone works) and just around n ln 2."""
    rng = np.random.default_rng(1)
    n = rng.integers(0, 1022, 100_000)
    return np.abs(np.concatenate([rng.uniform(-0.35, 0.35, 100_000), n * np.log(2) + rng.uniform(-1e-9, 1e-9, n.size)]))


def test_filtered_distribution_matches_transformers_on_a_real_vocabulary():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, 49152)) * 4
    got = compiled.filter_rows(x, [0.8], [0.02], [400], [0.9])
    scores = torch.tensor(x / 0.8)
    for warper in (MinPLogitsWarper(0.02), TopKLogitsWarper(400), TopPLogitsWarper(0.9)):
        scores = warper(None, scores)
    want = scores.numpy()
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(spec.softmax(got), spec.softmax(want), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("V", [3, 500, 49152])
def test_sample_rows_draw_the_token_draw_draws(V):
    rng = np.random.default_rng(V)
    for _ in range(20):
        x, *params = random_case(rng, V, 3, ties=V < 100)
        u = rng.random(3)
        want = spec.draw(numpy_filtered(x, *params), u)
        np.testing.assert_array_equal(compiled.sample_rows(x, *params, u), want)


def test_a_row_without_finite_logits_stays_and_draws_token_0_as_draw_does():
    x = np.full((2, 10), -np.inf)
    x[1, 4] = 1.0
    args = ([1.0, 1.0], [0.0, 0.0], [2, 2], [0.5, 0.5])
    out = compiled.filter_rows(x, *args)
    assert np.isneginf(out[0]).all() and np.isfinite(out[1]).sum() == 1
    assert compiled.sample_rows(x, *args, [0.3, 0.3]).tolist() == [0, 4]


def numpy_sampler_tokens(logits, states):
    """What Sampler drew before the compiled path: the NumPy chain, then draw at each row's uniform."""
    x = Sampler()._adjusted(logits, states)
    params = [s.params for s in states]
    filtered = numpy_filtered(x, *(np.array([getattr(p, n) for p in params])
                                   for n in ("temperature", "min_p", "top_k", "top_p")))
    return spec.draw(filtered, np.array([s.rng.random() for s in states]))


def test_seeded_sampling_gives_the_numpy_pipelines_tokens():
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((4, 49152)) * 3).astype(np.float32)
    configs = [dict(temperature=0.8, top_p=0.95), dict(temperature=1.0, top_k=40), dict(temperature=0.7, min_p=0.05),
               dict(temperature=1.3, top_k=100, top_p=0.9, min_p=0.01, repetition_penalty=1.2, frequency_penalty=0.5)]
    for seed in range(25):
        def states():
            return [SamplingState(SamplingParams(seed=seed + 97 * i, **c), prompt_ids=[5, 9, 9], output_ids=[1, 5, 77])
                    for i, c in enumerate(configs)]
        got = Sampler().sample(logits, states()).token_ids
        np.testing.assert_array_equal(got, numpy_sampler_tokens(logits, states()))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_candidate_scan_finds_what_flatnonzero_finds(dtype):
    """_ids_at_least: a handful of candidates (blocks counted, few scanned) or many (every block
    scanned), on chunks that start and end anywhere, at a bound that ties some logits."""
    rng = np.random.default_rng(5)
    for V in (1, 63, 64, 65, 1000, 49152):
        x = np.round(rng.standard_normal(V) * 3, 1).astype(dtype)
        for bound in (float(x.max()) + 1, float(x.max()), float(np.sort(x)[-min(V, 5)]), 0.0, float(x.min())):
            for lo, hi in ((0, V), (V // 3, V), (V // 7, V - V // 5)):
                ids = np.full(V, -1, dtype=np.int64)
                n = compiled._ids_at_least(x, bound, ids, lo, hi)
                want = lo + np.flatnonzero(x[lo:hi] >= bound)
                np.testing.assert_array_equal(ids[lo:lo + n], want)


def test_penalties_equal_the_numpy_function_bit_for_bit():
    rng = np.random.default_rng(11)
    V = 300
    logits = rng.standard_normal((3, V)) * 5
    prompts = [[1, 2, 2, 299], [], [7]]
    outputs = [[2, 3, 3, 3, 0], [4, 4], []]
    presence, frequency, repetition = np.array([0.5, -1.0, 2.0]), np.array([0.3, 1.5, -0.2]), np.array([1.3, 0.7, 2.0])
    got = compiled.apply_penalties(logits, prompts, outputs, presence, frequency, repetition)
    want = spec.apply_penalties(logits, prompts, outputs, presence, frequency, repetition)
    np.testing.assert_array_equal(got, want)


def test_penalties_refuse_token_ids_outside_the_vocabulary():
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 5\)"):
        compiled.apply_penalties(np.zeros((1, 5)), [[1]], [[5]], np.zeros(1), np.zeros(1), np.ones(1))



def test_a_replaced_filter_is_the_one_that_filters(monkeypatch):
    """The course seats a learner's top_p_filter in the module: the Sampler must then call it (and a
    correct one gives the compiled path's tokens)."""
    calls = []

    def learners_top_p(x, top_p):
        calls.append(len(x))
        return spec.SPEC_FILTERS[2](x, top_p)

    def draw_three():
        logits = np.random.default_rng(0).normal(size=(3, 50))
        states = [SamplingState(SamplingParams(temperature=0.8, top_p=0.9, seed=s), [1], []) for s in range(3)]
        return Sampler().sample(logits, states).token_ids.tolist()

    compiled_tokens = draw_three()
    monkeypatch.setattr(spec, "top_p_filter", learners_top_p)
    assert draw_three() == compiled_tokens and calls == [3]
