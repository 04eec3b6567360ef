"""Speculative decoding inside the engine: lossless against plain decoding and transformers, exact in
distribution at T > 0, and the cache rolled back with no block leaked."""

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm.generation.sampling import SamplingParams
from minillm.llm import load_tokenizer
from minillm.model.loader import load_model
from minillm.runtime.engine import LLMEngine
from tests.test_speculative import chi_square_critical

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
SELF = {"method": "self", "num_speculative_tokens": 3, "num_draft_layers": 1}

GROUNDED = [
    "Copy this sentence exactly: The committee approved the new budget for the library on Tuesday.",
    "Rewrite in lowercase: THE RIVER FLOWS THROUGH THE OLD TOWN AND INTO THE SEA.",
    "def area(width, height):\n    return width * height\n\n# The same function, renamed to rectangle_area:\n",
]
OPEN = ["Once upon a time", "The three primary colors are"]


def run(engine, prompts, params):
    """Every prompt through the engine; -> (outputs per request, stats). No block may leak."""
    ids = [engine.add_request(p, params[i] if isinstance(params, list) else params) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks, "blocks leaked"
    return [engine.pop_request(i).outputs for i in ids], stats


def check_counters(stats, k):
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert len(per_pos) == k and sum(per_pos) == stats.spec_decode_num_accepted_tokens
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))        # position j+1 is kept only after j
    assert stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert stats.spec_decode_num_draft_tokens <= k * stats.spec_decode_num_drafts


# -----------------------------------------------------------------------------------------------
# the real model


@pytest.fixture(scope="module")
def parts(smollm2_path):
    return load_model(smollm2_path), load_tokenizer(smollm2_path)


@pytest.mark.slow
def test_greedy_speculation_is_token_identical_on_smollm2(parts):
    model, tok = parts
    prompts = [tok.encode(p) for p in GROUNDED + OPEN]
    # greedy rows with every option that reads the history: penalties, min_tokens, logprobs, stop strings
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, logprobs=2),
              SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, min_tokens=5),
              SamplingParams(temperature=0, max_tokens=20, stop=["\n\n"]),
              SamplingParams(temperature=0, max_tokens=7)]
    plain, _ = run(LLMEngine(model, tok), prompts, params)
    for spec in (NGRAM, {**SELF, "num_draft_layers": 10}):
        outs, stats = run(LLMEngine(model, tok, speculative=spec), prompts, params)
        for got, want in zip(outs, plain):
            assert got[0].token_ids == want[0].token_ids and got[0].text == want[0].text
            assert got[0].finish_reason == want[0].finish_reason
        lp, want_lp = outs[1][0].logprobs, plain[1][0].logprobs
        assert [x.top_ids for x in lp] == [x.top_ids for x in want_lp]
        np.testing.assert_allclose([x.logprob for x in lp], [x.logprob for x in want_lp], atol=1e-3)
        assert stats.spec_decode_num_drafts > 0
        check_counters(stats, spec["num_speculative_tokens"])


# -----------------------------------------------------------------------------------------------
# a tiny random model: transformers is the oracle


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_path):
    """Two random layers over SmolLM2's vocabulary, so that its tokenizer detokenizes the output."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True)
    hf = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny")
    hf.save_pretrained(path)
    return hf, load_model(path), load_tokenizer(smollm2_path)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [NGRAM, SELF], ids=["ngram", "self"])
def test_greedy_speculation_equals_transformers_on_a_tiny_model(tiny, spec):
    hf, model, tok = tiny
    prompts = [[5, 17, 300, 17, 300, 17], [1000 + i for i in range(12)], [42]]
    outs, stats = run(LLMEngine(model, tok, speculative=spec), prompts,
                      SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):]
        assert out[0].token_ids == want.tolist()
    assert stats.spec_decode_num_accepted_tokens > 0
    check_counters(stats, spec["num_speculative_tokens"])


@pytest.mark.slow
@pytest.mark.parametrize("spec", [NGRAM, SELF], ids=["ngram", "self"])
def test_sampled_speculation_keeps_the_targets_distribution(tiny, spec):
    """T = 1, top_k = 2: the 8 three-token continuations against transformers' exact probabilities."""
    hf, model, tok = tiny
    prompt, trials = [7, 300, 301, 7, 300], 800

    def top2(context):  # the target's sampling distribution after context: top-2 softmax (V,) as a dict
        with torch.no_grad():
            logits = hf(torch.tensor([context])).logits[0, -1].double()
        values, ids = torch.topk(logits, 2)
        return dict(zip(ids.tolist(), torch.softmax(values, 0).tolist()))

    exact = {}
    for a, pa in top2(prompt).items():
        for b, pb in top2(prompt + [a]).items():
            for c, pc in top2(prompt + [a, b]).items():
                exact[(a, b, c)] = pa * pb * pc
    engine = LLMEngine(model, tok, speculative=spec, max_num_seqs=64)
    params = [SamplingParams(temperature=1.0, top_k=2, max_tokens=3, ignore_eos=True, seed=i) for i in range(trials)]
    outs, stats = run(engine, [prompt] * trials, params)
    counts = {key: 0 for key in exact}
    for out in outs:
        counts[tuple(out[0].token_ids)] += 1                         # a KeyError: a token outside the top 2
    chi2 = sum((counts[key] - trials * p) ** 2 / (trials * p) for key, p in exact.items())
    assert chi2 < chi_square_critical(len(exact) - 1), (chi2, counts, exact)
    # both branches of the rule ran: some draft tokens kept, some rejected
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
