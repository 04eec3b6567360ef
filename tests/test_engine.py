"""The continuous-batching engine on the real model: batching, chunking, preemption and forking
change when tokens are computed, never which tokens come out."""
import pytest

from minillm.generation.generate import Generation
from minillm.generation.sampling import SamplingParams
from minillm.llm import LLM, load_tokenizer
from minillm.model.loader import load_model
from minillm.runtime.engine import LLMEngine

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
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "blocks leaked"
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
    assert engine.scheduler.num_preemptions > 0
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
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.slow
def test_llm_generate_returns_outputs_in_input_order(smollm2_path, one_at_a_time):
    llm = LLM(smollm2_path)
    outs = llm.generate(PROMPTS[:6], GREEDY)
    assert [o.token_ids for o in outs] == one_at_a_time[:6]
    assert [o.prompt for o in outs] == PROMPTS[:6]
