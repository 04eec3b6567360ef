"""The engine's step under random workloads, on a tiny random model: the scheduler's contract holds.

Each workload mixes long prompts (chunked prefill under a small token budget), decode, n > 1
(forks sharing the prompt's blocks), n-gram speculation, guided JSON with jump-forward, aborts and
a KV cache small enough that sequences are preempted. After every step the block accounting must
hold - every block is owned or free, each block's reference count equals the tables holding it,
and exactly the running sequences hold blocks. At the end every request has finished exactly once
(or was aborted, and never finished), no block is held, and every greedy completion equals the
oracle: the same request run alone, one at a time, without speculation, on a roomy cache.
"""
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings, strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from minillm.generation.sampling import SamplingParams
from minillm.llm import load_tokenizer
from minillm.model.loader import load_model
from minillm.runtime.engine import FINISH_ABORT, LLMEngine
from minillm.runtime.paged_cache import bytes_per_token

BLOCK_SIZE, BUDGET, MAX_SEQS, K = 4, 16, 4, 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1}
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "size": {"type": "integer"}},
          "required": ["color", "size"]}
ALPHABET_SIZE = 6  # prompts draw from few ids, so that prompt lookup finds matches and drafts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_path):
    """Two random layers over SmolLM2's vocabulary, so that its tokenizer detokenizes and guides."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("tiny-properties")
    LlamaForCausalLM(config).eval().save_pretrained(path)
    model, tok = load_model(path), load_tokenizer(smollm2_path)
    # The ids: tokens this model itself produces, so that prompts shuffling them make prompt lookup
    # propose what the model might say next - sometimes right, often wrong: drafts get rejected too.
    engine = LLMEngine(model, tok, kv_cache_bytes=64 * bytes_per_token(model.config) * BLOCK_SIZE, block_size=BLOCK_SIZE)
    alphabet = []
    for start in range(300, 400):
        rid = engine.add_request([start], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        alphabet += [t for t in [start, *engine.pop_request(rid).outputs[0].token_ids] if t not in alphabet]
        if len(alphabet) >= ALPHABET_SIZE:
            return model, tok, {}, alphabet[:ALPHABET_SIZE]
    raise AssertionError("the tiny model repeats itself too much for a varied alphabet")


def params_of(req):
    guided = {"guided_json": SCHEMA} if req["guided"] else {}
    return SamplingParams(temperature=0, max_tokens=req["max_tokens"], n=req["n"], ignore_eos=not req["guided"],
                          **guided)


def alone(tiny, req):
    """The oracle: the request by itself on a roomy cache, no speculation -> its completion's token ids."""
    model, tok, memo, _ = tiny
    key = (tuple(req["prompt"]), req["max_tokens"], req["guided"])
    if key not in memo:
        engine = LLMEngine(model, tok, kv_cache_bytes=256 * bytes_per_token(model.config) * BLOCK_SIZE,
                           block_size=BLOCK_SIZE)
        rid = engine.add_request(req["prompt"], params_of({**req, "n": 1}))
        while engine.has_unfinished():
            engine.step()
        memo[key] = engine.pop_request(rid).outputs[0].token_ids
    return memo[key]


def check_blocks(engine):
    """Every block owned or free; reference counts equal the tables holding each block; only running
    sequences hold blocks."""
    bm, sched = engine.block_manager, engine.scheduler
    holders = {}
    for seq_id, blocks in bm.seqs.items():
        assert len(set(blocks.block_table)) == len(blocks.block_table)
        for block_id in blocks.block_table:
            holders[block_id] = holders.get(block_id, 0) + 1
    for block in bm.pool.blocks:
        assert block.ref_count == holders.get(block.block_id, 0)
    assert bm.num_free_blocks == sum(b.ref_count == 0 for b in bm.pool.blocks)
    assert set(bm.seqs) == {s.seq_id for s in sched.running}
    for seq in sched.running:   # every token to compute but the newest, and the drafter's lookahead, has a slot
        assert seq.num_computed_tokens <= bm.num_slots(seq.seq_id)


requests = st.fixed_dictionaries({
    "prompt": st.one_of(st.lists(st.integers(0, ALPHABET_SIZE - 1), min_size=1, max_size=8),   # letters
                        st.lists(st.integers(0, ALPHABET_SIZE - 1), min_size=BUDGET + 1, max_size=40)),  # chunked
    "max_tokens": st.integers(1, 10),
    "n": st.sampled_from([1, 2]),
    "guided": st.booleans(),
    "arrival": st.integers(0, 4),
    "abort_at": st.none() | st.none() | st.integers(0, 8),
})


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(workload=st.lists(requests, min_size=1, max_size=5), speculate=st.booleans(), spare_blocks=st.integers(0, 2))
def test_random_workloads_keep_the_accounting_and_give_the_one_at_a_time_tokens(tiny, workload, speculate,
                                                                                 spare_blocks):
    model, tok, _, alphabet = tiny
    workload = [{**r, "prompt": [alphabet[i] for i in r["prompt"]]} for r in workload]
    # the longest sequence fits alone (+ 1: the copy of a fork's shared tail): anything more may preempt
    need = max(-(-(len(r["prompt"]) + r["max_tokens"]) // BLOCK_SIZE) + 1 for r in workload)
    engine = LLMEngine(model, tok, kv_cache_bytes=(need + spare_blocks) * bytes_per_token(model.config) * BLOCK_SIZE,
                       block_size=BLOCK_SIZE, max_num_seqs=MAX_SEQS, max_num_batched_tokens=BUDGET,
                       speculative=NGRAM if speculate else None)
    ids, requests_in, finishes = {}, {}, {}
    for t in range(2000):
        for i, req in enumerate(workload):
            if req["arrival"] == t:
                ids[i] = engine.add_request(req["prompt"], params_of(req))
                requests_in[i] = engine.requests[ids[i]]   # abort forgets it: keep it to read its outputs
            if req["abort_at"] == t and i in ids:
                engine.abort(ids[i])
        if t > 4 and not engine.has_unfinished():
            break
        outs = engine.step()
        if not speculate and len(outs) > len({(o.request_id, o.index) for o in outs}):
            event("jump-forward")        # a sequence got several tokens from one forward
        for out in outs:
            assert (out.request_id, out.index) not in finishes, "a completion finished twice"
            if out.finished:
                finishes[(out.request_id, out.index)] = out.finish_reason
        check_blocks(engine)
    assert not engine.has_unfinished()
    stats = engine.stats()   # what the workload exercised (pytest --hypothesis-show-statistics)
    for name, happened in (("preemption", stats.num_preemptions), ("drafts accepted", stats.spec_decode_num_accepted_tokens),
                           ("drafts rejected", stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens),
                           ("n > 1", any(r["n"] > 1 for r in workload)), ("chunked prefill", any(len(r["prompt"]) > BUDGET for r in workload))):
        if happened:
            event(name)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.seqs, "blocks leaked"
    for i, req in enumerate(workload):
        want = alone(tiny, req)
        for c, out in enumerate(requests_in[i].outputs):
            if out.finish_reason == FINISH_ABORT:    # aborted after some tokens: those are the oracle's
                assert (ids[i], c) not in finishes and out.token_ids == want[:len(out.token_ids)]
            else:
                assert finishes[(ids[i], c)] == out.finish_reason
                assert out.token_ids == want, f"request {i} completion {c}"
