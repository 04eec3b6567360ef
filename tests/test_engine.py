"""The continuous-batching engine on the real model: batching, chunking, preemption and forking
change when tokens are computed, never which tokens come out."""
import re

import pytest

from minillm.generation.generate import Generation
from minillm.generation.sampling import SamplingParams
from minillm.llm import LLM, load_tokenizer
from minillm.model.loader import load_model
from minillm.runtime.engine import LLMEngine
from minillm.runtime.errors import RequestRejected

PROMPTS = [
    "Once upon a time", "def fibonacci(n):", "The three primary colors are", "1, 2, 3, 4,",
    "Water boils at", "In 1969, astronauts", "import numpy as np\n", "The best way to learn is",
    "Roses are red,", "A haiku about the sea:", "SELECT * FROM", "The mitochondria is",
    "Paris is the capital of", "To be or not to be,", "Dear diary, today", "The quick brown fox",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def parts(smollm2_path):
    return load_model(smollm2_path), load_tokenizer(smollm2_path)


def run_engine(parts, prompt_ids, params, **engine_args):
    engine = LLMEngine(*parts, **engine_args)
    ids = [engine.add_request(p, params) for p in prompt_ids]
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks, "blocks leaked"
    return [engine.pop_request(i).outputs for i in ids], engine


@pytest.fixture(scope="module")
def prompt_ids(parts):
    return [parts[1].encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def one_at_a_time(parts, prompt_ids):
    outs, _ = run_engine(parts, prompt_ids, GREEDY, max_num_seqs=1)
    return [o[0].token_ids for o in outs]


@pytest.mark.slow
def test_single_sequence_engine_equals_the_chapter_06_loop(parts, prompt_ids, one_at_a_time):
    for ids, expected in zip(prompt_ids[:4], one_at_a_time):
        assert Generation(*parts, ids, GREEDY).run().token_ids == expected


@pytest.mark.slow
@pytest.mark.parametrize("batch", [4, 16])
def test_batch_invariance(parts, prompt_ids, one_at_a_time, batch):
    outs, _ = run_engine(parts, prompt_ids, GREEDY, max_num_seqs=batch)
    assert [o[0].token_ids for o in outs] == one_at_a_time


@pytest.mark.slow
def test_chunked_prefill_gives_the_same_tokens(parts, prompt_ids, one_at_a_time):
    outs, _ = run_engine(parts, prompt_ids, GREEDY, max_num_seqs=8, max_num_batched_tokens=5)
    assert [o[0].token_ids for o in outs] == one_at_a_time


@pytest.mark.slow
def test_preempted_requests_end_with_their_unpreempted_output(parts, prompt_ids, one_at_a_time):
    from minillm.runtime.paged_cache import bytes_per_token

    per_token = bytes_per_token(parts[0].config)
    outs, engine = run_engine(parts, prompt_ids, GREEDY, max_num_seqs=16, block_size=4,
                              kv_cache_bytes=per_token * 4 * 24)  # 24 blocks: far too few for 16 sequences
    assert engine.stats().num_preemptions > 0
    assert [o[0].token_ids for o in outs] == one_at_a_time


@pytest.mark.slow
def test_n_completions_fork_the_prompt_and_sample_like_separate_requests(parts, prompt_ids):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    outs, _ = run_engine(parts, prompt_ids[:2], params, block_size=4)
    for ids, request in zip(prompt_ids, outs):
        assert [o.index for o in request] == [0, 1, 2]
        for choice, out in enumerate(request):
            assert out.token_ids == Generation(*parts, ids, params, choice=choice).run().token_ids


@pytest.mark.slow
def test_abort_in_every_state_frees_the_blocks(parts, prompt_ids):
    engine = LLMEngine(*parts, max_num_seqs=2, max_num_batched_tokens=6)
    a, b, c = (engine.add_request(p, GREEDY) for p in prompt_ids[:3])
    engine.step()  # a and b admitted (b mid-prefill), c waiting
    engine.step()
    engine.abort(c)  # waiting
    engine.abort(b)  # running
    engine.step()
    engine.abort(a)
    assert not engine.has_unfinished()
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.slow
def test_llm_generate_returns_outputs_in_input_order(smollm2_path, one_at_a_time):
    llm = LLM(smollm2_path)
    outs = llm.generate(PROMPTS[:6], GREEDY)
    assert [o.token_ids for o in outs] == one_at_a_time[:6]
    assert [o.prompt for o in outs] == PROMPTS[:6]


# -----------------------------------------------------------------------------------------------
# The contract with the layers above: StepOutput, stats(), observe(), RequestRejected


@pytest.mark.slow
def test_step_outputs_say_everything_a_caller_needs(parts, prompt_ids, one_at_a_time):
    params = SamplingParams(n=2, temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    engine = LLMEngine(*parts)
    rid = engine.add_request(prompt_ids[0], params)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    request = engine.pop_request(rid)
    for index, completion in enumerate(request.outputs):
        mine = [o for o in outputs if o.index == index]
        assert [o.token_id for o in mine] == completion.token_ids == one_at_a_time[0]  # greedy: both the same
        assert "".join(o.text_delta for o in mine) == completion.text
        assert [o.logprobs for o in mine] == completion.logprobs
        assert all(o.logprobs.token_id == o.token_id for o in mine)
        assert [o.finished for o in mine] == [False] * 11 + [True] and mine[-1].finish_reason == "length"
    assert [o.first_token for o in outputs] == [True] + [False] * (len(outputs) - 1)  # once per request
    assert [o.request_finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert engine.step() == []


@pytest.mark.slow
def test_stats_count_what_the_engine_did(parts, prompt_ids):
    from minillm.runtime.paged_cache import bytes_per_token

    engine = LLMEngine(*parts, max_num_seqs=2, max_num_batched_tokens=64, block_size=4,
                       kv_cache_bytes=bytes_per_token(parts[0].config) * 4 * 100)  # 100 blocks of 4
    stats = engine.stats()
    assert (stats.num_blocks, stats.num_free_blocks, stats.block_size) == (100, 100, 4)
    assert (stats.max_num_seqs, stats.max_num_batched_tokens) == (2, 64)
    assert stats.max_model_len == min(parts[0].config.context_length, 400) == 400  # the KV cache binds
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    for ids in prompt_ids[:3]:
        engine.add_request(ids, GREEDY)
    assert engine.stats().num_waiting == 3
    engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (2, 1)  # max_num_seqs admits two
    assert stats.num_free_blocks == 100 - sum(-(-len(ids) // 4) for ids in prompt_ids[:2])  # the prompts' blocks
    assert stats.kv_cache_usage == pytest.approx((100 - stats.num_free_blocks) / 100)
    assert stats.prefix_cache_queries == sum(len(ids) for ids in prompt_ids[:2]) and stats.prefix_cache_hits == 0
    while engine.has_unfinished():
        engine.step()
    engine.add_request(prompt_ids[0], GREEDY)  # the same prompt again: its full blocks are cached
    engine.step()
    stats = engine.stats()
    assert stats.prefix_cache_hits == (len(prompt_ids[0]) - 1) // 4 * 4
    assert stats.prefix_cache_queries == sum(len(ids) for ids in prompt_ids[:3]) + len(prompt_ids[0])


def test_a_request_that_ends_at_its_first_token_lends_its_prompt_to_the_next(parts, prompt_ids):
    """Its blocks are hashed before the token that finishes it frees them (they used to be freed unhashed)."""
    engine, prompt = LLMEngine(*parts, block_size=4), [t for ids in prompt_ids for t in ids]   # several blocks
    for _ in range(2):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1))
        while engine.has_unfinished():
            engine.step()
    assert engine.stats().prefix_cache_hits == (len(prompt) - 1) // 4 * 4 > 0


@pytest.mark.slow
def test_observe_sees_every_plan_before_its_forward(parts, prompt_ids):
    engine = LLMEngine(*parts, max_num_seqs=2, max_num_batched_tokens=6)
    plans, outputs = [], []
    stop = engine.observe(lambda plan, outs: (plans.append(plan), outputs.append(outs)))
    for ids in prompt_ids[:3]:
        engine.add_request(ids, GREEDY)
    steps = []
    while engine.has_unfinished():
        steps.append(engine.step())
    assert outputs == steps and len(plans) == len(steps)
    first = plans[0]
    assert [(p.seq_id, p.num_new, p.is_prefill) for p in first.scheduled] == [(0, len(prompt_ids[0]), True),
                                                                              (1, 6 - len(prompt_ids[0]), True)]
    assert first.waiting == [2] and first.preempted == []
    for plan in plans:
        assert sum(p.num_new for p in plan.scheduled) <= 6
        assert all(p.num_new == 1 for p in plan.scheduled if not p.is_prefill)
    decode_tokens = sum(1 for plan in plans for p in plan.scheduled if not p.is_prefill)
    assert decode_tokens == 3 * (GREEDY.max_tokens - 1)  # every token but the first comes from a decode step
    stop()
    engine.add_request(prompt_ids[0], GREEDY)
    engine.step()
    assert len(plans) == len(steps), "an unobserved engine calls nobody"


@pytest.mark.slow
@pytest.mark.parametrize("prompt, params, param, code, words", [
    ([], GREEDY, "prompt", None, "prompt is empty"),
    ([1, 2, 10**9], GREEDY, "prompt", None, "outside the vocabulary"),
    ([1, 2], SamplingParams(stop_token_ids=[10**9]), "stop_token_ids", None, "outside the vocabulary"),
    ([1, 2], SamplingParams(n=5), "n", None, "n = 5 exceeds this engine's limit of 4 completions per request"),
    ([1] * 400, GREEDY, "prompt", "context_length_exceeded", "maximum context length is 400 tokens"),
    ([1] * 390, GREEDY, "max_tokens", "context_length_exceeded", "you requested 402 tokens"),
])
def test_requests_that_cannot_run_are_rejected_with_the_field_and_code(parts, prompt, params, param, code, words):
    from minillm.runtime.paged_cache import bytes_per_token

    engine = LLMEngine(*parts, max_num_seqs=4, block_size=4, kv_cache_bytes=bytes_per_token(parts[0].config) * 400)
    with pytest.raises(RequestRejected, match=re.escape(words)) as e:
        engine.add_request(prompt, params)
    assert isinstance(e.value, ValueError) and (e.value.param, e.value.code) == (param, code)
    assert not engine.has_unfinished() and engine.stats().num_free_blocks == engine.stats().num_blocks


@pytest.mark.slow
def test_without_max_tokens_a_request_runs_to_the_longest_sequence_the_cache_holds(parts):
    from minillm.runtime.paged_cache import bytes_per_token

    engine = LLMEngine(*parts, block_size=4, kv_cache_bytes=bytes_per_token(parts[0].config) * 24)  # 24 tokens
    rid = engine.add_request([1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    out = engine.pop_request(rid).outputs[0]
    assert len(out.token_ids) == 24 - 4 and out.finish_reason == "length"


# -----------------------------------------------------------------------------------------------
# LLM.stream drives the same engine


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path)


@pytest.mark.slow
def test_stream_gives_generates_text_for_every_sampling_field(llm):
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1, seed=3,
                            max_tokens=20, stop=[" the"], min_tokens=2)
    whole = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0]
    assert "".join(llm.stream("Once upon a time", params)) == whole.text
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_blocks


@pytest.mark.slow
def test_stream_refuses_n_above_one_and_bad_requests_before_it_starts(llm):
    with pytest.raises(ValueError, match=r"stream yields one completion, but n = 2: use generate\(\) for n > 1"):
        llm.stream("Once upon a time", SamplingParams(n=2))
    with pytest.raises(RequestRejected, match="maximum context length") as e:
        llm.stream([1] * llm.engine.stats().max_model_len, SamplingParams())
    assert e.value.param == "prompt" and not llm.engine.has_unfinished()


@pytest.mark.slow
def test_leaving_a_stream_early_aborts_its_request(llm):
    pieces = llm.stream("Once upon a time", SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    next(pieces)
    assert llm.engine.stats().num_running == 1
    pieces.close()  # what `break` in a for loop does
    stats = llm.engine.stats()
    assert not llm.engine.has_unfinished() and stats.num_free_blocks == stats.num_blocks
