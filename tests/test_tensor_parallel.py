"""Tensor parallelism (gloo, CPU) against the one-process model, the oracle.

The same flat batches - a prefill of two prompts, then decode steps - run on a group of ranks and
on one process; logits must agree to fp32 tolerance (the ranks sum their partial products in
another order) and the greedy tokens must be equal: on SmolLM2 with 2 ranks (its 3 KV heads split
2 + 1), on tiny random models with 3 ranks (uneven vocabulary and FFN splits). A rank killed
mid-run must end the run with an error naming it, and closing a group must leave no process.

One process holds one group at a time (torch.distributed's default group): the ``groups``
fixture keeps the current one and swaps it when a test asks for another.
"""
import functools
import gc
import importlib
import os
import signal
import sys
import time

import numpy as np
import pytest
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from minillm.generation.sampling import SamplingParams
from minillm.kernels.registry import get_backend
from minillm.llm import LLM, load_tokenizer
from minillm.model.loader import load_model, read_weights
from minillm.model.sharding import Shard, read_shard, shard_range, weight_bytes
from minillm.runtime.engine import LLMEngine
from minillm.runtime.paged_cache import PagedAttentionMetadata, PagedKVCache
from minillm.runtime.tensor_parallel import RankFailed, TensorParallelGroup
from test_transformer import randomize_norms

TIMEOUT = 20.0  # seconds a collective waits: a killed rank must be reported well within it
BLOCK_SIZE, NUM_BLOCKS = 16, 8


def tiny_model_dir(path, family: str, tied: bool):
    """A 2-layer random model whose 3 KV heads allow 3 ranks; vocabulary 250 and F 96 split unevenly."""
    import torch

    torch.manual_seed(0)
    config = {"llama": LlamaConfig, "qwen3": Qwen3Config}[family](
        vocab_size=250, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=3, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5,
        tie_word_embeddings=tied, initializer_range=0.1)
    model = AutoModelForCausalLM.from_config(config).eval()
    randomize_norms(model)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def model_paths(smollm2_path, tmp_path_factory):
    return {"smollm2": smollm2_path,
            "tiny-llama": tiny_model_dir(tmp_path_factory.mktemp("llama"), "llama", tied=True),
            "tiny-qwen3": tiny_model_dir(tmp_path_factory.mktemp("qwen3"), "qwen3", tied=False)}


@pytest.fixture(scope="module")
def groups(model_paths):
    """groups(name, world_size) -> a running TensorParallelGroup; the previous one is closed first."""
    current = {}

    def start(name: str, world_size: int) -> TensorParallelGroup:
        key = (name, world_size)
        if current.get("key") != key or current["group"].closed:
            if current:
                current["group"].close()
            current.update(key=key, group=TensorParallelGroup(model_paths[name], world_size, timeout=TIMEOUT))
        return current["group"]

    yield start
    if current:
        current["group"].close()


@pytest.fixture(scope="module")
def oracles(model_paths):
    """The one-process models, loaded once each."""
    return {name: load_model(path) for name, path in model_paths.items()}


# -----------------------------------------------------------------------------
# the same steps on the ranks and on one process

def run_steps(forward, config, prompts, decode_steps: int, tokens=None) -> tuple[list[np.ndarray], list]:
    """Prefill the prompts as one flat batch, then decode; each step's logits (B, V) and tokens fed.

    ``tokens``: the decode tokens to feed (from another run); None: this run's argmax.
    """
    cache = PagedKVCache(config, NUM_BLOCKS, BLOCK_SIZE, get_backend("numba"))
    tables = [[2 * b, 2 * b + 1] for b in range(len(prompts))]   # two blocks of 16 per sequence
    lens, contexts = [len(p) for p in prompts], [0] * len(prompts)
    ids = np.concatenate(prompts)
    all_logits, fed = [], []
    for step in range(decode_steps + 1):
        meta = PagedAttentionMetadata.build(lens, contexts, tables, BLOCK_SIZE)
        logits = forward(ids, meta, cache)                          # (B, V)
        all_logits.append(logits)
        ids = logits.argmax(axis=1) if tokens is None else tokens[step]
        fed.append(ids)
        contexts = [c + n for c, n in zip(contexts, lens)]
        lens = [1] * len(prompts)
    return all_logits, fed


def group_forward(group: TensorParallelGroup):
    """A forward on the group: each rank with its own cache of the same blocks."""
    group.send("cache", NUM_BLOCKS, BLOCK_SIZE)
    rank0_cache = PagedKVCache(group.model.config, NUM_BLOCKS, BLOCK_SIZE, group.model.ops)

    def forward(ids, meta, _):
        group.send("step", [], ids, meta, None)   # no copies; every layer
        return group.forward(ids, meta, rank0_cache)
    return forward


def check_logits(group: TensorParallelGroup, oracle) -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, oracle.config.vocab_size, n) for n in (23, 9)]
    expected, fed = run_steps(lambda ids, meta, cache: oracle.forward(ids, meta, cache), oracle.config, prompts, 4)
    got, _ = run_steps(group_forward(group), group.model.config, prompts, 4, tokens=fed)
    for step, (g, e) in enumerate(zip(got, expected)):
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-4 * np.abs(e).max(), err_msg=f"step {step}")
        assert np.array_equal(g.argmax(axis=1), e.argmax(axis=1)), f"step {step}"


# (tests run in file order, grouped by the group they need: each group starts once)

def test_smollm2_logits_on_2_ranks_match_one_process(groups, oracles):
    check_logits(groups("smollm2", 2), oracles["smollm2"])


def test_greedy_tokens_on_2_ranks_equal_one_process_on_smollm2(groups, oracles, model_paths):
    tokenizer = load_tokenizer(model_paths["smollm2"])
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def greedy(engine):
        ids = [engine.add_request(tokenizer.encode(p), params) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        return [engine.pop_request(i).outputs[0].token_ids for i in ids]

    expected = greedy(LLMEngine(oracles["smollm2"], tokenizer, kv_cache_bytes=32 << 20))
    group = groups("smollm2", 2)
    got = greedy(LLMEngine(group.model, tokenizer, kv_cache_bytes=32 << 20, tensor_parallel=group))
    assert got == expected
    timings = group.timings(reset=True)
    assert [t.rank for t in timings] == [0, 1] and all(t.steps > 0 for t in timings)
    assert all(0 < t.collective_seconds < t.forward_seconds for t in timings)


def test_rank0_holds_only_its_shard(groups, oracles):
    group = groups("smollm2", 2)
    assert weight_bytes(group.model.weights) < 0.6 * weight_bytes(oracles["smollm2"].weights)


# disable_by_batch_size fixes the rule: every step of these two sequences drafts (the measured rule
# would weigh step times first; this test is about both ranks running the drafts)
@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 2},
                                  {"method": "self", "num_speculative_tokens": 3, "num_draft_layers": 22,
                                   "disable_by_batch_size": 2}],
                         ids=["ngram", "early-exit"])
def test_speculation_on_2_ranks_gives_one_process_greedy_tokens(groups, oracles, model_paths, spec):
    """What LLM(tensor_parallel_size=2, speculative=spec) builds: the group's engine with a drafter.
    The early-exit drafter's forwards go through the runner, so rank 1 runs them too (a rank that
    missed one would deadlock the next collective or leave its cache without the draft's K/V)."""
    tokenizer = load_tokenizer(model_paths["smollm2"])
    prompts = ["Copy this sentence exactly: The committee approved the new budget for the library on Tuesday.",
               "Rewrite in lowercase: THE RIVER FLOWS THROUGH THE OLD TOWN AND INTO THE SEA."]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def greedy(engine):
        ids = [engine.add_request(tokenizer.encode(p), params) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        assert engine.stats().num_free_blocks == engine.stats().num_blocks, "blocks leaked"
        return [engine.pop_request(i).outputs[0].token_ids for i in ids]

    expected = greedy(LLMEngine(oracles["smollm2"], tokenizer, kv_cache_bytes=32 << 20))
    group = groups("smollm2", 2)
    group.timings(reset=True)
    engine = LLMEngine(group.model, tokenizer, kv_cache_bytes=32 << 20, tensor_parallel=group, speculative=spec)
    assert greedy(engine) == expected
    stats = engine.stats()
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted_tokens > 0
    steps = [t.steps for t in group.timings(reset=True)]
    assert steps[0] == steps[1] > 0                                  # every forward ran on both ranks


def test_bad_tensor_parallel_arguments_are_refused(groups, model_paths):
    for size in (0, -1, 1.5):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            LLM(model_paths["smollm2"], tensor_parallel_size=size)


def test_qwen3_logits_on_2_ranks_match_one_process(groups, oracles):
    check_logits(groups("tiny-qwen3", 2), oracles["tiny-qwen3"])


def test_closing_a_group_leaves_no_process(groups):
    group = groups("tiny-qwen3", 2)
    group.close()
    assert not any(p.is_alive() for p in group.workers) and not dist.is_initialized()


def test_llama_logits_on_3_ranks_match_one_process(groups, oracles):
    check_logits(groups("tiny-llama", 3), oracles["tiny-llama"])


def test_a_killed_rank_ends_the_run_with_its_name(groups):
    group = groups("tiny-llama", 3)
    forward = group_forward(group)
    forward(np.arange(5), PagedAttentionMetadata.build([5], [0], [[0]], BLOCK_SIZE), None)  # the group works
    os.kill(group.workers[1].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 2 died"):
        for position in range(5, 10):
            forward(np.array([1]), PagedAttentionMetadata.build([1], [position], [[0]], BLOCK_SIZE), None)
    assert time.monotonic() - start < TIMEOUT
    # the group closed itself: the surviving rank is stopped too
    assert group.closed and not dist.is_initialized() and not any(p.is_alive() for p in group.workers)
    with pytest.raises(RankFailed, match="closed"):
        forward(np.array([1]), PagedAttentionMetadata.build([1], [5], [[0]], BLOCK_SIZE), None)


def test_a_dropped_group_leaves_no_process(model_paths):
    group = TensorParallelGroup(model_paths["tiny-llama"], 2, timeout=TIMEOUT)
    workers = list(group.workers)
    del group
    gc.collect()
    assert not any(p.is_alive() for p in workers) and not dist.is_initialized()


def test_setup_runs_in_every_worker_and_collect_asks_every_rank(model_paths):
    """What the course relies on to run the learner's split in the ranks (tensor_parallel_seat.py)."""
    group = TensorParallelGroup(model_paths["tiny-llama"], 3, timeout=TIMEOUT,
                                setup=functools.partial(sys.setrecursionlimit, 4321))
    try:
        assert group.collect(os.getpid) == [os.getpid()] + [p.pid for p in group.workers]
        assert group.collect(sys.getrecursionlimit)[1:] == [4321, 4321]   # rank 0 is the caller's to set up
        check_logits(group, load_model(model_paths["tiny-llama"]))       # and the group still computes
    finally:
        group.close()


def test_a_setup_that_fails_ends_the_start_with_the_rank_named(model_paths):
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 died .* while starting"):
        TensorParallelGroup(model_paths["tiny-llama"], 2, timeout=TIMEOUT,
                            setup=functools.partial(importlib.import_module, "no_module_of_this_name"))
    assert time.monotonic() - start < TIMEOUT and not dist.is_initialized()


# -----------------------------------------------------------------------------
# the split itself

def test_shard_ranges_are_contiguous_and_as_even_as_possible():
    assert [shard_range(3, 2, r) for r in range(2)] == [(0, 2), (2, 3)]
    assert [shard_range(250, 3, r) for r in range(3)] == [(0, 84), (84, 167), (167, 250)]
    assert [shard_range(96, 3, r, unit=32) for r in range(3)] == [(0, 32), (32, 64), (64, 96)]
    assert [shard_range(160, 2, r, unit=32) for r in range(2)] == [(0, 96), (96, 160)]
    with pytest.raises(ValueError, match="units"):
        shard_range(64, 3, 0, unit=32)


def test_more_ranks_than_kv_heads_are_refused(oracles, model_paths):
    config = oracles["smollm2"].config
    assert [Shard.plan(config, 2, r).kv_heads for r in range(2)] == [(0, 2), (2, 3)]
    assert [Shard.plan(config, 2, r).heads for r in range(2)] == [(0, 6), (6, 9)]   # whole GQA groups
    with pytest.raises(ValueError, match="tensor_parallel_size 4 exceeds the model's 3 KV heads"):
        Shard.plan(config, 4, 0)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 exceeds"):  # before any process starts
        TensorParallelGroup(model_paths["tiny-llama"], 4)


@pytest.mark.parametrize("world_size", [2, 3])
def test_memory_per_rank_is_about_a_share_of_the_weights(smollm2_path, world_size):
    """Facts from the loaded arrays: the shards hold every weight once, plus a copy of the norms each."""
    config, weights = read_weights(smollm2_path)
    full = weight_bytes(weights)
    shards = [weight_bytes(read_shard(smollm2_path, world_size, r)[2]) for r in range(world_size)]
    norms = sum(layer.attn_norm.nbytes + layer.mlp_norm.nbytes for layer in weights.layers) + weights.final_norm.nbytes
    assert sum(shards) == full + (world_size - 1) * norms
    assert max(shards) < 1.15 * full / world_size   # the uneven head split costs a little (2 + 1 at N = 2)
