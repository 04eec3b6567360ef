"""The model resident on the GPU against the CPU engine: the same greedy tokens, and a bus that
carries only the step's small integer arrays in and the sampled rows' logits out.

Tiny random Llama and Qwen3 (QK-norm) models in GGUF Q8_0 (benchmarks/tiny_model.py); the CPU side
loads the very same file on the numba backend (itself checked against transformers in
tests/test_transformer.py). Under the simulator a forward costs ~10 s a token (every GPU thread is a
Python thread), so the engine test packs every scheduling case into one short run per family.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from tiny_model import write_tiny_gguf  # noqa: E402  (benchmarks/ is a folder of scripts)

from minillm.generation.sampling import SamplingParams  # noqa: E402
from minillm.model.loader import load_model  # noqa: E402
from minillm.llm import LLM  # noqa: E402
from minillm.runtime.paged_cache import bytes_per_token  # noqa: E402


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_gguf(request, tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp(request.param) / "tiny.gguf", request.param)


def run_engine(path, device: str, prompts, params, **args):
    """Generate through LLM(device=...), recording every step's plan, the device forward's bus
    traffic (None on the CPU) and how many rows it asked logits for, and how many copy-on-write block
    copies the cache made."""
    llm = LLM(path, device=device, **args)
    steps, copies, logit_rows = [], [], []
    llm.engine.observe(lambda plan, _: steps.append((plan, getattr(llm.model, "last_forward", None),
                                                     logit_rows[-1])))
    runner, cache = llm.engine.runner, llm.engine.runner.cache
    prepare, copy_block = runner.prepare, cache.copy_block

    def prepare_counted(scheduled):  # a chunk that does not end its prompt (or recompute) asks none
        token_ids, meta = prepare(scheduled)
        logit_rows.append(len(meta.logits_indices))
        return token_ids, meta

    runner.prepare = prepare_counted
    cache.copy_block = lambda src, dst: (copies.append((src, dst)), copy_block(src, dst))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [[o.token_ids for o in out.outputs] for out in outputs], llm.engine.stats(), steps, copies, llm.model


def test_llm_on_the_device_generates_the_cpu_engines_greedy_tokens_moving_only_small_arrays(tiny_gguf):
    """Chunked prefill, several sequences, a prefix-cache hit, n = 2 forks (copy-on-write of a
    partly filled block) and a preemption, through the same scheduler and block manager: the
    tokens are the CPU engine's. And every step's bus traffic is the batch's small integer arrays
    in and the sampled rows' logits out - never a weight or a K/V byte."""
    # 3 tokens in blocks of 2: block 1 is partly filled when the first prompt forks, so its first decode
    # copies it; the second prompt shares the first's block 0 (a prefix hit); 4 blocks for 4 sequences:
    # a preemption. 9 tokens of forwards in all (the simulator costs ~10 s a token).
    prompts = [[3, 1, 4], [3, 1, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, n=2)  # each prompt forks in two
    config = load_model(tiny_gguf, backend="reference").config
    args = dict(block_size=2, max_num_seqs=3, max_num_batched_tokens=2,  # the first prompt prefills in 2 chunks
                kv_cache_bytes=bytes_per_token(config) * 8)               # 4 blocks: too few for all four
    cpu_tokens, cpu_stats, _, cpu_copies, _ = run_engine(tiny_gguf, "cpu", prompts, params, **args)
    gpu_tokens, gpu_stats, steps, gpu_copies, model = run_engine(tiny_gguf, "cuda", prompts, params, **args)
    assert gpu_tokens == cpu_tokens
    assert gpu_stats.num_preemptions == cpu_stats.num_preemptions >= 1
    assert gpu_stats.prefix_cache_hits == cpu_stats.prefix_cache_hits >= 2
    assert gpu_copies == cpu_copies and len(gpu_copies) >= 1

    weights = model.weights
    smallest_weight = min(w.nbytes for w in (weights.embedding, *weights.layers[0].qkv, weights.layers[0].wo))
    k_cache_of_one_layer = gpu_stats.num_blocks * gpu_stats.block_size * bytes_per_token(config) // (2 * config.n_layers)
    decode_steps = 0
    for plan, traffic, rows in steps:
        assert traffic.to_host_copies == 1  # the logits of the rows that sample, nothing else
        assert traffic.to_host_bytes == rows * config.vocab_size * 4
        assert traffic.to_device_bytes < min(smallest_weight, k_cache_of_one_layer)  # no weight, no K/V cache
        if all(s.num_new == 1 and not s.is_prefill for s in plan.scheduled):
            decode_steps += 1
            # token ids, positions, slot mapping, block tables, query rows (2), logit rows: a handful
            assert traffic.to_device_copies <= 8
            assert traffic.launches >= 8 * config.n_layers  # norms, matvecs, rope, K/V write, attention, adds
    assert decode_steps >= 1


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
