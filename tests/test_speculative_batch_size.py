"""``disable_by_batch_size``: no drafts in a step that schedules more sequences than the limit,
drafts again once the batch shrinks, and the tokens those steps emit are plain decoding's."""
import pytest

from minillm.generation.sampling import SamplingParams
from minillm.runtime.engine import LLMEngine
from minillm.runtime.speculative import SpeculativeConfig
from tests.test_speculative_engine import run, tiny  # noqa: F401  (tiny: the module's fixture)

# prompts that repeat themselves, so prompt lookup always has something to propose
PROMPTS = [[5, 17, 300, 17, 300, 17], [9, 40, 9, 40, 9, 40, 9], [7, 8, 7, 8, 7, 8]]
LIMIT = 2


@pytest.mark.slow
def test_no_drafts_while_the_batch_exceeds_the_limit(tiny):  # noqa: F811
    _, model, tok = tiny
    # the first request runs longest: once the other two finish, the batch (1) is within the limit
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (40, 8, 8)]
    engine = LLMEngine(model, tok, speculative={"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_min": 1, "disable_by_batch_size": LIMIT})
    steps = []                                                        # (sequences scheduled, drafts so far)
    engine.observe(lambda plan, outputs: steps.append((len(plan.scheduled), engine.stats().spec_decode_num_drafts)))
    outs, _ = run(engine, PROMPTS, params)
    drafted = [(batch, after - before) for (batch, after), (_, before) in zip(steps, [(0, 0)] + steps)]
    assert all(n == 0 for batch, n in drafted if batch > LIMIT)
    assert any(n > 0 for batch, n in drafted if batch <= LIMIT)      # once the batch shrank, drafts came back
    plain, _ = run(LLMEngine(model, tok), PROMPTS, params)
    assert [o[0].token_ids for o in outs] == [o[0].token_ids for o in plain]


@pytest.mark.parametrize("bad", [0, -3, 2.5, "8", True])
def test_a_bad_limit_is_named(bad):
    with pytest.raises(ValueError, match="disable_by_batch_size must be an integer >= 1 or None"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, disable_by_batch_size=bad)
