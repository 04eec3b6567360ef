"""Generation through the paged KV cache gives the tokens of the contiguous cache (chapter 06's
``Generation``), on the real model, greedy - also when the prompt's leading blocks come from the
prefix cache instead of being computed.

Prefix caching only skips work: a cached block holds exactly the K/V its tokens would produce, so
a request served from the cache must continue with the same tokens as one computed from scratch.
Which tokens are found there is a fact of block-level caching: the full blocks of the longest
common prefix, never the prompt's last token (its logits choose the first new token).
"""
import pytest

from minillm.generation.chat import render_chat
from minillm.generation.generate import Generation
from minillm.generation.sampling import SamplingParams
from minillm.llm import load_tokenizer
from minillm.model.loader import load_model
from minillm.runtime.engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK_SIZE = 16
SYSTEM = ("You are the support assistant of a small bakery in Lyon. Answer in at most three sentences, "
          "politely and precisely. The bakery opens at seven in the morning and closes at seven in the "
          "evening, every day except Monday. It sells bread, croissants, pastries and cakes to order; "
          "cakes need two days' notice. Payment by card or cash. There is no parking, but a tram stop "
          "is two minutes away. Never invent prices: say that the shop will confirm them.")


@pytest.fixture(scope="module")
def parts(smollm2_path):
    return load_model(smollm2_path), load_tokenizer(smollm2_path)


def chat_ids(tokenizer, question):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    text = render_chat(messages, tokenizer.chat_template, add_generation_prompt=True)
    return tokenizer.encode(text, add_bos=False)


@pytest.fixture(scope="module")
def contiguous(parts):
    """The oracle: chapter 06's single-request loop over a contiguous cache (each prompt run once)."""
    done = {}

    def tokens(prompt_ids):
        key = tuple(prompt_ids)
        if key not in done:
            done[key] = Generation(*parts, prompt_ids, GREEDY).run().token_ids
        return done[key]
    return tokens


def run_to_end(engine, prompt_ids):
    """One request through the engine alone; its tokens and the prompt tokens found cached."""
    hits_before = engine.block_manager.prefix_cache_hits
    rid = engine.add_request(prompt_ids, GREEDY)
    while engine.has_unfinished():
        engine.step()
    return engine.pop_request(rid).outputs[0].token_ids, engine.block_manager.prefix_cache_hits - hits_before


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.slow
def test_a_shared_system_prompt_is_reused_and_the_tokens_do_not_change(parts, contiguous):
    tokenizer = parts[1]
    first = chat_ids(tokenizer, "When do you open on Sunday?")
    second = chat_ids(tokenizer, "Can I order a birthday cake for tomorrow?")
    shared = common_prefix(first, second)
    assert shared > 4 * BLOCK_SIZE, "the system prompt should span several blocks"
    engine = LLMEngine(*parts, block_size=BLOCK_SIZE)

    cold, cold_hits = run_to_end(engine, first)
    warm, warm_hits = run_to_end(engine, second)  # admitted after the first finished: its blocks are cached

    assert cold_hits == 0
    assert warm_hits == shared // BLOCK_SIZE * BLOCK_SIZE > 0
    assert cold == contiguous(first)
    assert warm == contiguous(second)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "blocks leaked"


@pytest.mark.slow
@pytest.mark.parametrize("length", [4 * BLOCK_SIZE, 4 * BLOCK_SIZE + 1])
def test_a_fully_cached_prompt_recomputes_its_last_token(parts, contiguous, length):
    # length 64: the last full block is recomputed (48 cached); length 65: only the last token (64 cached)
    prompt = chat_ids(parts[1], "Tell me about your croissants.")[:length]
    engine = LLMEngine(*parts, block_size=BLOCK_SIZE)

    cold, _ = run_to_end(engine, prompt)
    again, hits = run_to_end(engine, prompt)

    assert hits == (length - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert cold == again == contiguous(prompt)


@pytest.mark.slow
def test_a_prefix_shared_with_a_running_request_gives_both_their_tokens(parts, contiguous):
    # The second request arrives while the first decodes: both block tables hold the prefix blocks.
    # A budget of 7 tokens per step chunks both prefills, the second on top of its cached prefix.
    tokenizer = parts[1]
    first = chat_ids(tokenizer, "Do you sell gluten-free bread?")
    second = chat_ids(tokenizer, "Where can I park?")
    engine = LLMEngine(*parts, block_size=BLOCK_SIZE, max_num_batched_tokens=7)
    a = engine.add_request(first, GREEDY)
    while not engine.requests[a].seqs[0].output_ids:  # prefill the first prompt: its blocks are cached
        engine.step()
    b = engine.add_request(second, GREEDY)
    engine.step()
    assert engine.block_manager.prefix_cache_hits == common_prefix(first, second) // BLOCK_SIZE * BLOCK_SIZE
    tables = [engine.block_manager.block_table(engine.requests[r].seqs[0].seq_id) for r in (a, b)]
    shared_blocks = set(tables[0]) & set(tables[1])
    assert len(shared_blocks) == common_prefix(first, second) // BLOCK_SIZE
    while engine.has_unfinished():
        engine.step()
    assert engine.pop_request(a).outputs[0].token_ids == contiguous(first)
    assert engine.pop_request(b).outputs[0].token_ids == contiguous(second)
