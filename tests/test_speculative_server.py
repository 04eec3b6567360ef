"""The server's cases with speculation on: the same answers as plain decoding, over real HTTP.

One server runs SmolLM2 with prompt lookup (``--speculative-config``'s dict); the oracle is the
plain engine on the same model file, whose greedy decoding the transformer tests already hold to
transformers. The prompt asks the model to copy a passage, so drafts are long and mostly kept:
stop strings, ``max_tokens`` and EOS then land in the middle of accepted drafts, where a wrong
cut would show. Every case ends with every KV block back in the pool.
"""
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minillm.generation.sampling import SamplingParams
from minillm.llm import LLM
from minillm.serve.app import BackgroundServer, llm_app
from tests.test_server import assert_all_blocks_free

pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1}
PASSAGE = ("The council met on Tuesday to discuss the new library. The members voted seven to two to approve a "
           "budget of four million euros, and construction will begin in March.")
COPY = [{"role": "user", "content": f"Repeat the following text exactly:\n\n{PASSAGE}"}]
PROMPT = f"Text: {PASSAGE}\nThe same text again: The council"


@pytest.fixture(scope="module")
def plain(smollm2_path):
    return LLM(smollm2_path)


@pytest.fixture(scope="module")
def server(smollm2_path):
    with BackgroundServer(llm_app(LLM(smollm2_path, max_num_seqs=8, speculative=NGRAM))) as server:
        yield server


def plain_completion(plain, prompt_ids, **params):
    """The plain engine's greedy completion (a CompletionOutput)."""
    return plain.generate([prompt_ids], SamplingParams(temperature=0, **params), use_tqdm=False)[0].outputs[0]


def test_streamed_chat_equals_plain_decoding_and_drafts_were_kept(client, model, server, plain):
    want = plain_completion(plain, plain.chat_prompt(COPY), max_tokens=64)
    whole = client.chat.completions.create(model=model, messages=COPY, temperature=0, max_tokens=64)
    chunks = list(client.chat.completions.create(model=model, messages=COPY, temperature=0, max_tokens=64,
                                                 stream=True, stream_options={"include_usage": True}))
    assert whole.choices[0].message.content == want.text
    assert whole.choices[0].finish_reason == want.finish_reason
    assert whole.usage.completion_tokens == len(want.token_ids)
    *content, usage = chunks
    assert "".join(c.choices[0].delta.content or "" for c in content) == want.text
    assert [c.choices[0].finish_reason for c in content if c.choices[0].finish_reason] == [want.finish_reason]
    assert usage.usage.completion_tokens == len(want.token_ids)
    stats = server.app.state.client.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0.5 * stats.spec_decode_num_draft_tokens > 0  # a copy: mostly kept
    assert_all_blocks_free(server)


@pytest.fixture(scope="module")
def copied(plain):
    """The plain greedy continuation of PROMPT, 24 tokens."""
    return plain_completion(plain, plain.tokenizer.encode(PROMPT), max_tokens=24, ignore_eos=True)


def test_max_tokens_cuts_inside_a_draft(client, model, server, copied, plain):
    for max_tokens in (1, 7, 13):
        c = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == max_tokens
        assert c.choices[0].text == plain.tokenizer.decode(copied.token_ids[:max_tokens])
    assert_all_blocks_free(server)


def test_stop_strings_are_cut_out_mid_draft(client, model, server, copied):
    text = copied.text
    stop = text[len(text) // 2: len(text) // 2 + 3]                       # a piece plain decoding writes anyway
    ask = dict(model=model, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    c = client.completions.create(stop=[stop], **ask)
    assert c.choices[0].text == text[:text.find(stop)] and c.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(stop=[stop], stream=True, **ask))
    assert "".join(ch.choices[0].text for ch in streamed) == c.choices[0].text
    assert [ch.choices[0].finish_reason for ch in streamed if ch.choices[0].finish_reason] == ["stop"]
    assert_all_blocks_free(server)


def test_logprobs_are_plain_decodings(client, model, plain):
    want = plain_completion(plain, plain.tokenizer.encode(PROMPT), max_tokens=12, ignore_eos=True, logprobs=2)
    c = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-3)
    for top, entry in zip(lp.top_logprobs, want.logprobs):
        assert sorted(top.values(), reverse=True) == pytest.approx(entry.top_logprobs, abs=1e-3)


def test_n_greedy_choices_each_equal_plain_decoding(client, model, server, copied):
    whole = client.completions.create(model=model, prompt=PROMPT, n=2, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert sorted(c.index for c in whole.choices) == [0, 1]
    want = copied.token_ids[:16]
    assert [c.text for c in whole.choices] == [server.app.state.tokenizer.decode(want)] * 2
    assert whole.usage.completion_tokens == 2 * 16
    assert_all_blocks_free(server)


def test_sampled_requests_finish_once_per_choice_and_free_their_blocks(client, model, server):
    chunks = list(client.completions.create(model=model, prompt=PROMPT, n=3, max_tokens=10, temperature=0.8,
                                            seed=3, stream=True))
    for index in range(3):
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].index == index]
        assert sum(f is not None for f in finishes) == 1 and finishes[-1] is not None
    assert_all_blocks_free(server)


def test_metrics_count_drafts_under_vllms_names(server):
    text = httpx.get(server.url + "/metrics").text
    samples = {(s.name, s.labels.get("position")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    stats = server.app.state.client.engine.stats()
    assert samples["minillm:spec_decode_num_drafts_total", None] == stats.spec_decode_num_drafts > 0
    assert samples["minillm:spec_decode_num_draft_tokens_total", None] == stats.spec_decode_num_draft_tokens
    assert samples["minillm:spec_decode_num_accepted_tokens_total", None] == stats.spec_decode_num_accepted_tokens
    per_pos = [samples["minillm:spec_decode_num_accepted_tokens_per_pos_total", str(j)]
               for j in range(NGRAM["num_speculative_tokens"])]
    assert per_pos == list(stats.spec_decode_num_accepted_tokens_per_pos)
