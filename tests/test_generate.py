"""The autoregressive loop of chapter 06 (`Generation`) on the real model, against transformers."""
import numpy as np
import pytest
import torch

from minillm.generation.generate import Generation, check_prompt_fits, prefill
from minillm.generation.sampling import SamplingParams
from minillm.llm import LLM

# Greedy, ending at eos as transformers' generate does; 32 tokens at most.
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
RAW_PROMPTS = ["Once upon a time", "def fibonacci(n):", "The three primary colors are"]
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime number."}]]

# The Q4_1 weights are the same on both sides (transformers dequantizes the file to fp32); only
# the order of fp32 sums differs. Measured: max |diff| ~3e-5 on logits of size ~20.
LOGITS_ATOL = 1e-3


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path)


def generate(llm, prompt_ids, params):
    """One completion by the chapter 06 loop."""
    return Generation(llm.model, llm.tokenizer, prompt_ids, params).run()


def hf_greedy(hf_smollm2, prompt_ids, max_new):
    """transformers' greedy continuation, eos included when it ends there."""
    model, _ = hf_smollm2
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new, do_sample=False,
                             pad_token_id=2)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("prompt", RAW_PROMPTS)
def test_greedy_raw_prompts_match_transformers(llm, hf_smollm2, prompt):
    ids = llm.tokenizer.encode(prompt)
    ours = generate(llm, ids, GREEDY)
    assert ours.token_ids == hf_greedy(hf_smollm2, ids, 32)
    assert ours.finish_reason == "length" and len(ours.token_ids) == 32


@pytest.mark.slow
@pytest.mark.parametrize("messages", CHATS)
def test_greedy_chat_matches_transformers(llm, hf_smollm2, messages):
    _, hf_tok = hf_smollm2
    ids = llm.chat_prompt(messages)
    assert ids == hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ours = generate(llm, ids, GREEDY)
    assert ours.token_ids == hf_greedy(hf_smollm2, ids, 32)
    assert ours.finish_reason == "stop" and ours.token_ids[-1] == llm.tokenizer.eos_id


@pytest.mark.slow
def test_the_reference_answer_ends_at_eos(llm):
    """The fact to match (read off transformers on the default model): the greedy answer is "The capital of France is Paris." then <|im_end|>."""
    out = llm.chat(CHATS[0], SamplingParams(temperature=0.0, max_tokens=32))
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop" and out.token_ids[-1] == llm.tokenizer.eos_id


@pytest.mark.slow
def test_a_stop_string_spanning_tokens_is_cut_from_the_text(llm):
    ids = llm.tokenizer.encode(RAW_PROMPTS[0])
    full = generate(llm, ids, GREEDY)
    pieces = [llm.tokenizer.decode([t]) for t in full.token_ids]
    # a stop string made of the end of token 5 and the start of token 6
    k = 5
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    assert len(pieces[k]) >= 2 and len(pieces[k + 1]) >= 2
    cut = full.text.find(stop)
    out = generate(llm, ids, SamplingParams(temperature=0.0, max_tokens=32, stop=[stop]))
    assert out.text == full.text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop


@pytest.mark.slow
def test_max_tokens_ends_with_length_and_the_exact_count(llm):
    ids = llm.tokenizer.encode("Count: one, two,")
    out = generate(llm, ids, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


@pytest.mark.slow
def test_same_seed_same_text_and_streaming_equals_the_result(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24)
    ids = llm.tokenizer.encode("Tell me a story")
    a, b = generate(llm, ids, params), generate(llm, ids, params)
    assert a.token_ids == b.token_ids
    assert "".join(llm.stream("Tell me a story", params)) == a.text


@pytest.mark.slow
def test_timings_follow_the_token_times(llm):
    gen = Generation(llm.model, llm.tokenizer, llm.tokenizer.encode(RAW_PROMPTS[0]),
                     SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    with pytest.raises(RuntimeError, match="no token"):
        gen.timings()
    gen.run()
    t, times = gen.timings(), gen.token_times
    assert t.ttft_s == times[0] - gen.start and t.e2e_s == times[-1] - gen.start
    assert t.tpot_s == pytest.approx((times[-1] - times[0]) / 4)


@pytest.mark.slow
def test_a_prompt_longer_than_the_context_fails_before_any_compute(llm, monkeypatch):
    context = llm.model.config.context_length
    monkeypatch.setattr(llm.model, "forward", lambda *a: pytest.fail("computed"))
    with pytest.raises(ValueError, match=f"{context} tokens but the model's context holds {context}"):
        Generation(llm.model, llm.tokenizer, [5] * context, GREEDY)


def test_check_prompt_fits():
    check_prompt_fits(10, 11)
    with pytest.raises(ValueError, match="empty"):
        check_prompt_fits(0, 11)
    with pytest.raises(ValueError, match="11 tokens"):
        check_prompt_fits(11, 11)


@pytest.mark.slow
@pytest.mark.ch06_decode_step
def test_decode_steps_give_transformers_next_token_logits(impl, llm, request):
    """Prefill a prompt into cache slot 1 of 2, then two decode steps: each step's logits must be
    transformers' logits at that position of the whole sequence, run without any cache."""
    g = impl("ch06_generation")
    model, prompt = llm.model, llm.tokenizer.encode("The capital of France is")
    cache = model.new_cache(n_slots=2, max_len=len(prompt) + 2)
    sequence = [*prompt, int(np.argmax(prefill(model, cache, prompt, slot=1)))]
    steps = []
    for _ in range(2):
        logits = g.decode_step(model, cache, sequence[-1], len(sequence) - 1, slot=1)  # (V,)
        steps.append(logits)
        sequence.append(int(np.argmax(logits)))
    # The oracle loads only now: a blank stub fails above without paying for transformers (~2 min).
    hf_model, _ = request.getfixturevalue("hf_smollm2")
    with torch.no_grad():
        expected = hf_model(torch.tensor([sequence[:-1]])).logits[0, -2:].numpy()  # (2, V)
    for ours, theirs in zip(steps, expected):
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=LOGITS_ATOL)
        assert np.argmax(ours) == np.argmax(theirs)
