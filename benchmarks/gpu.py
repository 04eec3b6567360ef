"""The GPU check in one command, for a machine with an NVIDIA GPU (about 8 minutes in all):

    benchmarks/gpu.sh                   # or: .venv/bin/python benchmarks/gpu.py
    NUMBA_ENABLE_CUDASIM=1 .venv/bin/python benchmarks/gpu.py --dry-run   # no GPU: every path once

1. tests/cuda on the real device (the simulator-sized tests, now on hardware) -> pass/fail;
2. benchmarks/kernels_cuda.py (our kernels against PyTorch's, SmolLM2's shapes) -> kernels_cuda.json;
3. LLM(device="cuda") side by side with `transformers` on the same GPU, fp16 and fp32 eager, both
   on the same GGUF file (transformers dequantizes it): batch-1 decode tok/s, 512-token prefill
   tok/s, throughput at 1, 8, 32 and 64 sequences; and our host-wrapper backend (LLM(backend="cuda"))
   at batch 1, for the resident-vs-host-wrapper ratio; plus our copies, bytes and launches per
   decode step (model.last_forward) -> gpu_side_by_side.json, stamped with the GPU, its driver and
   the versions.

--dry-run (under the simulator; a test runs it): a tiny random model, every measurement once at
toy sizes, results written where --out says and marked `"timings_meaningless": true` - it proves
the script works, not how fast anything is. The goals the issue sets (recorded, never asserted):
batch-1 decode >= 1.0x transformers fp16; 64 sequences >= 20x batch 1; resident >= 50x host wrapper.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import RESULTS, save_result
from minillm.kernels.cuda.setup import SIMULATOR, cuda_available

ROOT = Path(__file__).resolve().parents[1]
FULL = dict(warmups=1, decode_tokens=64, prefill_tokens=512, batch_sizes=(1, 8, 32, 64), prompt_tokens=32,
            new_tokens=32, wrapper_tokens=3, kv_cache_bytes=None)
# The simulator compiles nothing (no warm-up) and takes ~10 s per token of a forward: 5 forwards of
# 1-2 tokens in all. Its device arrays are host memory: a KV cache sized for these toy requests.
DRY = dict(warmups=0, decode_tokens=1, prefill_tokens=1, batch_sizes=(1, 2), prompt_tokens=1, new_tokens=1,
           wrapper_tokens=0, kv_cache_bytes=1 << 20)
TESTS_TIMEOUT_S, KERNELS_TIMEOUT_S = 240, 120


def run_step(cmd: list[str], timeout: int) -> dict:
    """A subprocess with a time limit -> its status and last output lines (the device's own env: no simulator)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))  # and any packages carried there
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"command": " ".join(cmd), "status": f"timed out after {timeout} s"}
    lines = (done.stdout + done.stderr).strip().splitlines()
    failures = [line for line in lines[:-5] if line.startswith(("FAILED", "ERROR"))]  # pytest -rfE names them
    return {"command": " ".join(cmd), "status": "ok" if done.returncode == 0 else f"exit {done.returncode}",
            "tail": failures + lines[-5:]}


def pytest_command() -> list[str]:
    """tests/cuda on the device: every failure named (-rfE), not stopped at the first. Where the
    plugins are installed (the GPU image has them; our venv need not), the tests spread over the
    CPU cores (each test compiles its kernels, which is CPU work) and one slow test is failed by
    name instead of eating the step's whole budget - the first run on an H200 was cut at 240 s
    serially, and at 170 s with 12 workers one test had failed unnamed."""
    import importlib.util

    cmd = [sys.executable, "-m", "pytest", "tests/cuda", "-q", "-rfE",  # less this script's own dry run (the
           "--deselect", "tests/cuda/test_resident.py::test_gpu_check_dry_run_completes_on_the_simulator"]  # simulator: minutes)
    if importlib.util.find_spec("xdist"):
        cmd += ["-n", "8"]
    if importlib.util.find_spec("pytest_timeout"):
        cmd += ["--timeout", "90"]
    return cmd


def gpu_stamp() -> dict:
    """The device, its driver and the CUDA versions in play, for the result's stamp."""
    import dataclasses

    from numba import cuda

    from minillm.hardware.gpu import describe_gpu

    info = describe_gpu()
    stamp = dataclasses.asdict(info) if info is not None else {}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        stamp["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        stamp["driver"] = None
    stamp["cuda_driver_api"] = ".".join(map(str, cuda.cudadrv.driver.driver.get_version()))
    try:
        import torch

        stamp["torch_cuda"] = torch.version.cuda
    except ImportError:
        pass
    return stamp


# -----------------------------------------------------------------------------------------------
# timing one engine: decode, prefill, throughput


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_ours(llm, sizes: dict, rng: np.random.Generator, vocab: int) -> dict:
    from minillm import SamplingParams

    def generate(prompts, new_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        return seconds(lambda: llm.generate(prompts, params, use_tqdm=False))

    def prompt():  # a fresh one each time: a repeated prompt would be served from the prefix cache
        return [rng.integers(0, vocab, sizes["prefill_tokens"]).tolist()]

    for _ in range(sizes["warmups"]):
        generate(prompt(), 2)  # compiles every kernel
    first = generate(prompt(), 1)  # prefill + the first token
    whole = generate(prompt(), sizes["decode_tokens"] + 1)
    step = llm.model.last_forward  # its last forward was a decode step: its bus traffic and launches
    out = {"prefill_tok_s": sizes["prefill_tokens"] / first,
           "decode_tok_s": sizes["decode_tokens"] / max(whole - first, 1e-9),
           "decode_step": {"to_device_copies": step.to_device_copies, "to_device_bytes": step.to_device_bytes,
                           "to_host_copies": step.to_host_copies, "to_host_bytes": step.to_host_bytes,
                           "launches": step.launches},
           "throughput_tok_s": {}}
    for batch in sizes["batch_sizes"]:
        prompts = [rng.integers(0, vocab, sizes["prompt_tokens"]).tolist() for _ in range(batch)]
        out["throughput_tok_s"][batch] = batch * sizes["new_tokens"] / generate(prompts, sizes["new_tokens"])
    return out


def measure_transformers(gguf: Path, dtype: str, sizes: dict, rng: np.random.Generator, vocab: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype),
                                                 attn_implementation="eager").to(device).eval()

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def generate(batch, prompt_len, new_tokens):
        ids = torch.tensor(rng.integers(0, vocab, (batch, prompt_len)), device=device)
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

        def run():
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            sync()
        return seconds(run)

    for _ in range(sizes["warmups"]):
        generate(1, sizes["prefill_tokens"], 2)
    first = generate(1, sizes["prefill_tokens"], 1)
    whole = generate(1, sizes["prefill_tokens"], sizes["decode_tokens"] + 1)
    out = {"device": device, "prefill_tok_s": sizes["prefill_tokens"] / first,
           "decode_tok_s": sizes["decode_tokens"] / max(whole - first, 1e-9), "throughput_tok_s": {}}
    for batch in sizes["batch_sizes"]:
        out["throughput_tok_s"][batch] = batch * sizes["new_tokens"] / generate(batch, sizes["prompt_tokens"],
                                                                                 sizes["new_tokens"])
    del model
    return out


def measure_host_wrapper(gguf: Path, tokens: int, rng: np.random.Generator, vocab: int) -> dict:
    """The host-wrapper backend (every op copies its inputs, weights included): a few tokens are enough."""
    from minillm import LLM, SamplingParams

    llm = LLM(gguf, backend="cuda")

    def generate(new_tokens):
        prompt = [rng.integers(0, vocab, 8).tolist()]
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        return seconds(lambda: llm.generate(prompt, params, use_tqdm=False))

    generate(2)  # warm-up
    first, whole = generate(1), generate(tokens + 1)
    return {"decode_tok_s": tokens / max(whole - first, 1e-9)}


# -----------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="on the simulator: a tiny model, toy sizes")
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: SmolLM2-135M, fetched)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for gpu_*.json")
    args = parser.parse_args()
    available, reason = cuda_available()
    if args.dry_run != SIMULATOR or not available:
        print(f"{reason}\n--dry-run runs on the simulator only (NUMBA_ENABLE_CUDASIM=1), the full check on a GPU only")
        return 2
    from minillm import LLM

    rng = np.random.default_rng(0)
    sizes = DRY if args.dry_run else FULL
    results: dict = {"timings_meaningless": args.dry_run, "sizes": {k: list(v) if isinstance(v, tuple) else v
                                                                    for k, v in sizes.items()}}
    if args.dry_run:
        from tiny_model import write_tiny_gguf

        gguf = write_tiny_gguf(Path(tempfile.mkdtemp()) / "tiny.gguf")
        results["gpu"] = reason
        results["tests_cuda"] = results["kernels_cuda"] = "skipped: dry run (they need the real device)"
    else:
        from minillm.model.fetch import cached_model_path, fetch

        gguf = args.model or cached_model_path() or fetch()
        results["gpu"] = gpu_stamp()
        results["tests_cuda"] = run_step(pytest_command(), TESTS_TIMEOUT_S)
        results["kernels_cuda"] = run_step([sys.executable, "benchmarks/kernels_cuda.py", "--model", str(gguf),
                                            "--contexts", "128", "1024", "--repeats", "10"], KERNELS_TIMEOUT_S)
    llm = LLM(gguf, device="cuda", max_num_seqs=max(sizes["batch_sizes"]), kv_cache_bytes=sizes["kv_cache_bytes"])
    vocab = llm.model.config.vocab_size
    results["minillm_cuda"] = measure_ours(llm, sizes, rng, vocab)
    for dtype in ("float16", "float32"):
        results[f"transformers_{dtype}"] = measure_transformers(Path(gguf), dtype, sizes, rng, vocab)
    if sizes["wrapper_tokens"]:
        results["minillm_host_wrapper"] = measure_host_wrapper(Path(gguf), sizes["wrapper_tokens"], rng, vocab)
    ours = results["minillm_cuda"]
    results["goals"] = {  # recorded, not asserted
        "decode_vs_transformers_fp16": ours["decode_tok_s"] / results["transformers_float16"]["decode_tok_s"],
        "throughput_max_batch_vs_batch_1": (ours["throughput_tok_s"][sizes["batch_sizes"][-1]]
                                            / ours["throughput_tok_s"][sizes["batch_sizes"][0]]),
    }
    if "minillm_host_wrapper" in results:
        results["goals"]["resident_vs_host_wrapper"] = ours["decode_tok_s"] / results["minillm_host_wrapper"]["decode_tok_s"]
    save_result("gpu_side_by_side_dry_run" if args.dry_run else "gpu_side_by_side", results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
