"""The model resident on the GPU against the CPU engine: same logits, same greedy tokens, and a bus
that carries only the step's small integer arrays in and the sampled rows' logits out.

Tiny random Llama and Qwen3 (QK-norm) models in GGUF Q8_0 (benchmarks/tiny_model.py); the CPU side
loads the very same file on the numba backend (itself checked against transformers in
tests/test_transformer.py). Under the simulator a forward costs seconds, so each test runs few steps.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from tiny_model import write_tiny_gguf  # noqa: E402  (benchmarks/ is a folder of scripts)

from minillm.generation.sampling import SamplingParams  # noqa: E402
from minillm.model.device import to_device  # noqa: E402
from minillm.model.loader import load_model  # noqa: E402
from minillm.llm import LLM  # noqa: E402
from minillm.runtime.paged_cache import DevicePagedKVCache, PagedAttentionMetadata, PagedKVCache, bytes_per_token  # noqa: E402

ATOL = 2e-4  # fp32 on both sides, different summation orders over 2 layers


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def models(request, tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp(request.param) / "tiny.gguf", request.param)
    return path, load_model(path), to_device(load_model(path, backend="reference"))


def test_prefill_fork_and_decode_match_the_cpu_and_cross_the_bus_only_as_small_arrays(models):
    """A flat batch of two prompts (one split: its second chunk follows later), a copy-on-write of a
    block, then a decode step of three sequences - one of them the fork reading the copied block."""
    _, cpu, gpu = models
    caches = [PagedKVCache(cpu.config, 6, 4, cpu.ops), DevicePagedKVCache(gpu.config, 6, 4, gpu.ops)]
    rng = np.random.default_rng(0)
    steps = [  # (token ids, query_lens, context_lens, block tables)
        (rng.integers(0, 32, 9), [6, 3], [0, 0], [[0, 1], [2]]),
        (rng.integers(0, 32, 3), [1, 1, 1], [6, 3, 6], [[0, 1], [2], [0, 3]]),  # seq 3 forks seq 1 after block 0
    ]
    for (ids, lens, ctx, tables), copy in zip(steps, [None, (1, 3)]):
        if copy is not None:
            for cache in caches:
                cache.copy_block(*copy)
        meta = PagedAttentionMetadata.build(lens, ctx, tables, 4)
        expected = cpu.forward(ids, meta, caches[0])
        got = gpu.forward(ids, meta, caches[1])
        traffic = gpu.last_forward
        np.testing.assert_allclose(got, expected, atol=ATOL, rtol=ATOL)
    # the decode step: token ids, positions, slot mapping, block tables, query rows (2), logit rows in
    assert traffic.to_device_copies <= 8
    weight_bytes = sum(w.nbytes for w in (gpu.weights.embedding, *gpu.weights.layers[0].qkv))
    assert traffic.to_device_bytes < 512 < weight_bytes
    assert traffic.to_device_bytes < bytes_per_token(gpu.config)  # not even one token's K/V
    assert traffic.to_host_copies == 1 and traffic.to_host_bytes == expected.nbytes  # the logits, nothing else
    assert traffic.launches > 4 * gpu.config.n_layers


def test_llm_on_the_device_generates_the_cpu_engines_greedy_tokens(models):
    """Chunked prefill, several sequences, a prefix-cache hit, an n = 2 fork (copy-on-write) and a
    preemption, through the same scheduler and block manager: the tokens are the CPU engine's."""
    path, cpu, _ = models
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    prompts = [prompt, prompt[:4] + [7, 7]]  # the second shares the first's first block: a prefix hit
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, n=2)  # each prompt forks in two
    args = dict(block_size=4, max_num_seqs=3, max_num_batched_tokens=6,  # prompts prefill in chunks of <= 6
                kv_cache_bytes=bytes_per_token(cpu.config) * 16)          # 4 blocks: too few for all four
    results = []
    for device in ("cpu", "cuda"):
        llm = LLM(path, device=device, **args)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results.append(([[o.token_ids for o in out.outputs] for out in outputs], llm.engine.stats()))
    (cpu_tokens, cpu_stats), (gpu_tokens, gpu_stats) = results
    assert gpu_tokens == cpu_tokens
    assert gpu_stats.num_preemptions == cpu_stats.num_preemptions >= 1
    assert gpu_stats.prefix_cache_hits == cpu_stats.prefix_cache_hits >= 4


def test_a_device_request_without_gpu_or_simulator_is_refused_saying_how(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    code = "import minillm; minillm.LLM('/nonexistent.gguf', device='cuda')"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if "FileNotFoundError" in run.stderr:  # past the device check, to the missing file: a real GPU is here
        pytest.skip("this machine has a CUDA GPU: nothing to refuse")
    assert "RuntimeError" in run.stderr and "NUMBA_ENABLE_CUDASIM=1" in run.stderr, run.stderr


def test_a_bad_device_name_is_refused():
    import minillm

    with pytest.raises(ValueError, match="device must be one of cpu, cuda"):
        minillm.LLM("/nonexistent.gguf", device="tpu")


def test_gpu_check_dry_run_completes_on_the_simulator(tmp_path):
    """benchmarks/gpu.py --dry-run: every measurement once on a tiny model, results marked meaningless."""
    import json

    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--dry-run", "--out", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_side_by_side_dry_run.json").read_text())["results"]
    assert results["timings_meaningless"] is True
    step = results["minillm_cuda"]["decode_step"]
    assert step["to_host_copies"] == 1 and step["to_device_copies"] <= 8 and step["launches"] > 0
    for side in ("minillm_cuda", "transformers_float16", "transformers_float32"):
        assert set(results[side]["throughput_tok_s"]) == {"1", "2"}
