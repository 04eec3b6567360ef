"""The engines the benchmarks compare, one adapter each, built inside a worker process (``common.Worker``).

Every adapter takes the same GGUF file and thread count and answers the same calls:
- ``generate(prompt, new_tokens)``: greedy token ids, exactly ``new_tokens`` of them (eos never stops
  it), after the prompt's token ids - the decode and prefill protocol times this call;
- ``run_workload(workload)``: every (prompt ids, output length) request, greedy, eos ignored ->
  tokens generated - the offline throughput protocol times this call;
- ``stamp()``: what the engine runs on (its code path and threads), recorded in the result file.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from minillm.model.fetch import cached_model_path, fetch


def model_path(model: str | None) -> Path:
    return Path(model) if model else (cached_model_path() or fetch())


class Minillm:
    """``minillm.LLM`` - the path users run: the engine, its scheduler, the paged KV cache.

    ``mode`` names the activations: "fp32" (the default engine) or another type ``LLM`` accepts as
    ``activations=`` (e.g. "int8"); an ``LLM`` that does not accept it fails here, and the harness
    skips the mode with that message.
    """

    def __init__(self, threads: int, mode: str = "fp32", model: str | None = None):
        import numba

        import minillm

        numba.set_num_threads(threads)
        self.mode, self.path = mode, model_path(model)
        self.llm = minillm.LLM(self.path, **({} if mode == "fp32" else {"activations": mode}))

    def stamp(self) -> dict:
        import numba
        from common import numba_target

        import minillm

        target = numba_target()
        return {"isa": target["isa"], "mode": self.mode, "numba_threads": numba.get_num_threads(),
                "numba_target": target, "package": str(Path(minillm.__file__).parent)}  # which checkout ran

    def generate(self, prompt: list[int], new_tokens: int) -> list[int]:
        from minillm.generation.sampling import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        return self.llm.generate([prompt], params, use_tqdm=False)[0].token_ids

    def run_workload(self, workload: list[tuple[list[int], int]], max_num_seqs: int) -> int:
        """A fresh engine with a KV cache big enough that nothing is preempted, every request at once."""
        from minillm.generation.sampling import SamplingParams
        from minillm.runtime.engine import LLMEngine
        from minillm.runtime.paged_cache import bytes_per_token

        model, tokenizer = self.llm.model, self.llm.tokenizer
        longest = max(len(p) + n for p, n in workload)
        kv_bytes = bytes_per_token(model.config) * (longest + 16) * min(max_num_seqs, len(workload))
        engine = LLMEngine(model, tokenizer, kv_cache_bytes=kv_bytes, max_num_seqs=max_num_seqs)
        ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
               for p, n in workload]
        while engine.has_unfinished():
            engine.step()
        if engine.scheduler.num_preemptions:
            raise RuntimeError("the KV cache was too small: requests were preempted")
        return sum(len(engine.pop_request(i).outputs[0].token_ids) for i in ids)

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights a decode step reads: every layer, the final norm and the LM head (the
        embedding lookup reads one row only). Packed bytes for quantized weights."""
        from dataclasses import fields

        w = self.llm.model.weights
        arrays = [w.final_norm, w.lm_head]
        for layer in w.layers:  # the stored fields; derived ones (stacked qkv, gate_up) hold the same bytes
            arrays += [getattr(layer, f.name) for f in fields(layer) if f.init and getattr(layer, f.name) is not None]
        return sum(a.nbytes for a in arrays)


class Transformers:
    """Hugging Face ``transformers``: the same GGUF file dequantized to fp32, PyTorch eager."""

    def __init__(self, threads: int, model: str | None = None):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        torch.set_num_threads(threads)
        path = model_path(model)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                          dtype=torch.float32).eval()

    def stamp(self) -> dict:
        capability = self.torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", ...
        return {"isa": capability.lower(), "torch_threads": self.torch.get_num_threads(), "cpu_capability": capability,
                "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "default"),
                "mkl_enable_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS", "default")}

    def generate(self, prompt: list[int], new_tokens: int) -> list[int]:
        """A plain loop passing its KV cache along, computing the LM head for the last position only."""
        with self.torch.inference_mode():
            out = self.model(self.torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
            token = out.logits[0, -1].argmax()
            ids = [int(token)]
            for _ in range(new_tokens - 1):
                out = self.model(token.view(1, 1), cache=out.cache, use_cache=True)
                token = out.logits[0, -1].argmax()
                ids.append(int(token))
        return ids

    def run_workload(self, workload: list[tuple[list[int], int]]) -> int:
        """One batched ``generate``, left-padded. A padded batch is static: it runs until its longest
        output is done, computing that many tokens for every row; only the tokens each request asked
        for count as generated."""
        torch = self.torch
        width = max(len(p) for p, _ in workload)
        pad = self.model.config.pad_token_id or 0
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in workload])           # (B, width)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in workload])       # (B, width)
        longest = max(n for _, n in workload)
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                      max_new_tokens=longest, min_new_tokens=longest, pad_token_id=pad)
        if out.shape[1] != width + longest:
            raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, not {longest}")
        return sum(n for _, n in workload)


class LlamaCpp:
    """llama.cpp through ``llama_cpp.Llama`` (its own quantized kernels), one token per ``eval``."""

    def __init__(self, threads: int, model: str | None = None):
        import llama_cpp

        self.llama_cpp = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(model_path(model)), n_threads=threads, n_threads_batch=threads,
                                   n_ctx=2048, verbose=False)

    def stamp(self) -> dict:
        info = self.llama_cpp.llama_print_system_info().decode()  # "... AVX2 = 1 | ... | AVX512 = 0 | ..."
        isa = "avx512" if "AVX512 = 1" in info else "avx2" if "AVX2 = 1" in info else "neon" if "NEON = 1" in info \
            else "other"
        return {"isa": isa, "n_threads": self.llm.n_threads, "module": self.llama_cpp.__file__, "system_info": info}

    def _next(self, tokens: list[int]) -> int:
        """Evaluate tokens after what the context holds -> the argmax of the last one's logits.

        ``Llama.eval`` keeps every position's logits only when built with logits_all (which would
        compute the LM head for every prompt token): the last row is read straight from the context.
        """
        self.llm.eval(tokens)
        last = self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(last, shape=(self.llm.n_vocab(),))))

    def generate(self, prompt: list[int], new_tokens: int) -> list[int]:
        self.llm.reset()  # a new sequence; eval overwrites the old KV entries
        ids = [self._next(prompt)]
        for _ in range(new_tokens - 1):
            ids.append(self._next([ids[-1]]))
        return ids

    def run_workload(self, workload: list[tuple[list[int], int]]) -> int:
        """One request after the other: its Python API serves one sequence."""
        return sum(len(self.generate(prompt, n)) for prompt, n in workload)
