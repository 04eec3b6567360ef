"""The measured rule that cuts drafts (runtime/speculative.py: StepCosts, paying_draft_length):
its arithmetic against facts (a step whose cost grows with its rows as fast as the tokens it may
emit never pays; a step whose cost does not grow pays for every guess that may be kept), its
exploration, and the engine wired to it, with step costs given instead of timed."""
import pytest

from minillm.generation.sampling import SamplingParams
from minillm.runtime.engine import LLMEngine
from minillm.runtime.speculative import SeqRecord, SpeculativeConfig, SpeculativeDecoder, StepCosts
from tests.test_speculative_engine import run, tiny  # noqa: F401  (tiny: the module's fixture)

K = 4


def costs_of(seconds: dict[int, float]) -> StepCosts:
    costs = StepCosts()
    for rows, s in seconds.items():
        costs.record(rows, 99.0)  # a row count's first step (a compile) is not kept
        costs.record(rows, s)
    return costs


def test_step_costs_drop_the_first_step_and_keep_the_median_of_the_last_ones():
    costs = StepCosts()
    costs.record(3, 50.0)
    assert costs.seconds(3) is None
    for s in (1.0, 9.0, 2.0, 3.0, 4.0):  # the window keeps the last four: 9, 2, 3, 4
        costs.record(3, s)
    assert costs.seconds(3) == 3.5


def test_a_new_row_count_keeps_its_first_step_only_in_line_with_the_others():
    costs = costs_of({2: 2.0, 6: 4.0})
    costs.record(4, 3.5)          # the line through the others says 3.0: kept
    assert costs.seconds(4) == 3.5
    costs.record(8, 60.0)         # the line says 5.0: a compile, dropped
    assert costs.seconds(8) == 5.0
    costs.record(8, 5.5)          # a row count's second step is kept whatever it took
    assert costs.seconds(8) == 5.5


def test_step_costs_interpolate_and_extrapolate_along_straight_lines():
    costs = costs_of({2: 2.0, 6: 4.0})
    assert costs.seconds(4) == 3.0
    assert costs.seconds(10) == 6.0          # the line through the smallest and the largest
    assert costs.seconds(1) is None          # below every measurement: unknown
    assert costs_of({2: 2.0}).seconds(5) is None  # one row count says nothing about the slope


def decoder(costs: StepCosts) -> SpeculativeDecoder:
    d = SpeculativeDecoder(SpeculativeConfig(method="ngram", num_speculative_tokens=K), num_layers=2, max_model_len=64)
    d.costs = costs
    return d


def a_sequence():
    """A stand-in the rule can key its weak per-sequence records on."""
    return object.__new__(type("S", (), {"__weakref__": None}))


def record(accepted_at: list[int], drafted_at: list[int]) -> SeqRecord:
    return SeqRecord(drafted_at=drafted_at, accepted_at=accepted_at)


def test_expected_accepted_leans_on_the_prior_first_and_on_the_sequence_later():
    prior = [0.5, 0.4, 0.3, 0.2]
    assert SeqRecord().expected_accepted(3, prior) == pytest.approx([0, 0.5, 0.5 + 0.4, 0.5 + 0.4 + 0.3])  # the prior
    always = record(accepted_at=[10_000] * K, drafted_at=[10_000] * K)
    assert always.expected_accepted(K, prior) == pytest.approx(range(K + 1), rel=1e-3)  # a long history: its own
    once_missed = record(accepted_at=[1, 0, 0, 0], drafted_at=[1, 1, 0, 0])
    assert 0 < once_missed.expected_accepted(2, prior)[2] < 0.5 + 0.4 + 1              # one miss shuts nothing
    assert once_missed.expected_accepted(2, prior)[2] > SeqRecord().expected_accepted(1, prior)[1]


@pytest.mark.parametrize("batch", [1, 3])
def test_a_step_that_costs_its_rows_never_pays(batch):
    """Cost proportional to rows: a step emits at most one token per row, so tokens per second can
    only fall with drafts, even if every guess is kept."""
    d = decoder(costs_of({r: 0.01 * r for r in (batch, batch + 1, 4 * batch + batch)}))
    seqs = [a_sequence() for _ in range(batch)]
    for s in seqs:
        d.records[s] = record(accepted_at=[10] * K, drafted_at=[10] * K)
    assert d.paying_draft_length(batch, [(s, K) for s in seqs]) == 0


def test_a_step_whose_cost_does_not_grow_takes_every_guess_that_may_be_kept():
    seq = a_sequence()
    d = decoder(costs_of({1: 0.01, 1 + K: 0.01}))
    d.records[seq] = record(accepted_at=[5, 5, 5, 1], drafted_at=[10, 10, 10, 10])
    assert d.paying_draft_length(1, [(seq, K)]) == K    # free rows: any chance of a kept guess pays


def test_guesses_that_are_never_kept_are_not_drafted_when_rows_cost_something():
    seq = a_sequence()
    d = decoder(costs_of({1: 0.0100, 1 + K: 0.0100 + 0.001 * K}))   # a row costs a tenth of a step
    d.stats.accepted_per_pos, d.drafted_at = [0] * K, [100] * K       # no sequence's guess was ever kept
    d.records[seq] = record(accepted_at=[0] * K, drafted_at=[10] * K)
    assert d.paying_draft_length(1, [(seq, K)]) == 0
    d.stats.accepted_per_pos = [90, 80, 70, 60]                        # ... and where they usually are
    d.records[seq] = record(accepted_at=[9, 8, 7, 6], drafted_at=[10] * K)
    assert d.paying_draft_length(1, [(seq, K)]) == K


def test_a_position_never_tried_counts_as_the_last_tried_one_not_as_certain():
    seq = a_sequence()
    d = decoder(costs_of({1: 0.010, 2: 0.017}))                        # a guess costs 0.7 of a plain step
    d.stats.accepted_per_pos, d.drafted_at = [5, 0, 0, 0], [10, 0, 0, 0]  # only first guesses verified: 6/11 kept
    # each guess is worth 6/11 of a token at most, for 0.7 of a step: no length pays (taking the untried
    # positions as certain, four guesses would: 1 + 6/11 + 3 tokens for 3.8 steps' time)
    assert d.paying_draft_length(1, [(seq, K)]) == 0


def test_a_gain_within_the_spread_of_the_plain_steps_timings_is_not_taken():
    seq = a_sequence()
    d = decoder(costs_of({1: 0.010, 1 + K: 0.014}))           # four guesses for 40% more time
    d.records[seq] = record(accepted_at=[3, 2, 1, 0], drafted_at=[10] * K)
    assert d.costs.spread(1) == 1.0
    assert d.paying_draft_length(1, [(seq, K)]) > 0           # steady timings: up to 1.6 more tokens for 1.4 steps' time
    for seconds in (0.007, 0.013, 0.008):                     # the plain step's timings spread 0.007-0.013 s
        d.costs.record(1, seconds)
    assert d.costs.spread(1) == pytest.approx(0.013 / 0.007)
    assert d.paying_draft_length(1, [(seq, K)]) == 0


def test_unmeasured_shapes_are_measured_first_with_one_guess_a_sequence():
    seq, other = (a_sequence() for _ in range(2))
    assert decoder(StepCosts()).paying_draft_length(1, [(seq, K)]) == 0        # a plain step first
    assert decoder(costs_of({1: 0.01})).paying_draft_length(1, [(seq, K)]) == 1  # then the cheapest verify
    assert decoder(costs_of({2: 0.01})).paying_draft_length(2, [(seq, K), (other, 0)]) == 1
    # once the one-guess step is measured, longer drafts are weighed on the line through the two:
    # rows that cost nothing more take every guess, rows that cost their share take none
    assert decoder(costs_of({1: 0.01, 2: 0.01})).paying_draft_length(1, [(seq, K)]) == K
    assert decoder(costs_of({1: 0.01, 2: 0.02})).paying_draft_length(1, [(seq, K)]) == 0


class GivenCosts(StepCosts):
    """Step costs given as a function of rows; the engine's timings are ignored."""

    def __init__(self, seconds):
        super().__init__()
        self.given = seconds

    def record(self, rows, seconds):
        pass

    def seconds(self, rows):
        return self.given(rows)


@pytest.mark.slow
@pytest.mark.parametrize("seconds, drafts", [(lambda rows: 1.0, True), (lambda rows: 0.01 * rows, False)],
                         ids=["memory-bound", "compute-bound"])
def test_the_engine_drafts_only_where_the_given_costs_pay(tiny, seconds, drafts):  # noqa: F811
    _, model, tok = tiny
    prompts = [[5, 17, 300, 17, 300, 17], [9, 40, 9, 40, 9, 40, 9], [7, 8, 7, 8, 7, 8]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine = LLMEngine(model, tok, speculative={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    engine.speculative.costs = GivenCosts(seconds)
    outs, stats = run(engine, prompts, params)
    assert (stats.spec_decode_num_drafts > 0) == drafts
    plain, _ = run(LLMEngine(model, tok), prompts, params)
    assert [o[0].token_ids for o in outs] == [o[0].token_ids for o in plain]
