"""``minillm.LLM``: the public face - load a model, generate, stream, chat.

    llm = minillm.LLM()                                 # the default model (fetched on first use)
    outs = llm.generate(["Once upon a time"], minillm.SamplingParams(temperature=0, max_tokens=32))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason
    for piece in llm.stream("Once upon a time", params): print(piece, end="")

``generate``, ``stream`` and ``chat`` all drive one ``LLMEngine`` (paged KV cache, prefix cache,
continuous batching): a conversation that grows turn by turn finds its earlier turns cached. Each
call steps the engine until its own requests are done, so use one call at a time (the server's
engine thread is the way to serve many callers at once).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

# tqdm.std, not tqdm.auto: a plain-text bar in notebooks too (auto's widget needs ipywidgets and
# shows as a bare object repr in a notebook rendered on GitHub).
from tqdm.std import tqdm

from minillm.generation.chat import render_chat_parts
from minillm.generation.output import CompletionOutput
from minillm.generation.sampling import SamplingParams
from minillm.generation.tokenizer import Tokenizer
from minillm.model.fetch import cached_model_path, fetch
from minillm.model.loader import load_model
from minillm.runtime.config import EngineConfig
from minillm.runtime.engine import LLMEngine

Prompt = str | Sequence[int]


@dataclass
class RequestOutput:
    """A request's result: its prompt and its ``n`` completions (``text`` etc. are the first's)."""
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason


def model_path(model: str | Path | None) -> Path:
    """The model's file or folder: ``model``, else the default model (fetched on first use)."""
    return Path(model) if model is not None else (cached_model_path() or fetch())


def load_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer that travels with a model: GGUF metadata, or tokenizer.json in an HF folder."""
    return Tokenizer.from_hf_json(path) if path.is_dir() else Tokenizer.from_gguf(path)


def chat_prompt(tokenizer: Tokenizer, messages: Sequence[dict], max_tokens: int | None = None) -> list[int]:
    """The token ids of a conversation rendered with the model's chat template (the tokenizer carries
    it). Message contents are plain text: a special token typed in one is its characters, not the
    control token. ``max_tokens``: see ``Tokenizer.encode`` (``TooManyTokens``)."""
    parts = render_chat_parts(messages, tokenizer.chat_template, add_generation_prompt=True,
                              special_tokens=tokenizer.added_token_ids, bos_token=tokenizer.bos_token or "",
                              eos_token=tokenizer.eos_token or "")
    return tokenizer.encode_parts(parts, add_bos=False, max_tokens=max_tokens)


def check_device_request(device: str, backend: str, activations: str, tensor_parallel_size: int) -> None:
    """A device other than the CPU, refused before anything loads if this machine or the options can't run it."""
    from minillm.model.device import check_device  # numba.cuda loads only when a device is asked for

    check_device(device)
    if backend != "numba" or activations != "fp32" or tensor_parallel_size != 1:
        raise ValueError(f"device={device!r} runs its own resident kernels with fp32 activations on one GPU: "
                         f"leave backend, activations and tensor_parallel_size at their defaults "
                         f"(got {backend!r}, {activations!r}, {tensor_parallel_size})")


class LLM:
    """A model with its tokenizer, ready to generate."""

    def __init__(self, model: str | Path | EngineConfig | None = None, **options):
        """``LLM("model.gguf", max_num_seqs=16)`` or ``LLM(EngineConfig(...))``: ``options`` are the fields of
        ``EngineConfig`` (an unknown one is a TypeError naming it), e.g. ``activations`` ("fp32" or "int8",
        how the linear layers take their input), ``tensor_parallel_size`` (> 1 splits the model over that
        many processes; this one is rank 0; ``close()`` stops the others), ``kv_cache_bytes``,
        ``max_num_seqs``, ``speculative`` (vLLM's speculative_config, e.g. ``{"method": "ngram",
        "num_speculative_tokens": 4}``), ``device`` ("cuda": the whole model resident on the GPU - weights
        uploaded once, the paged KV cache in device memory - refused at once, saying how to use the
        simulator, where neither a GPU nor NUMBA_ENABLE_CUDASIM=1 is)."""
        if isinstance(model, EngineConfig):
            self.config = EngineConfig.create(model, **options)
        else:
            self.config = EngineConfig.create(model=model, **options)
        config = self.config
        self.path = model_path(config.model)
        if config.device != "cpu":
            check_device_request(config.device, config.backend, config.activations, config.tensor_parallel_size)
        self.tensor_parallel = None
        if config.tensor_parallel_size > 1:
            from minillm.runtime.tensor_parallel import TensorParallelGroup  # torch loads only here

            self.tensor_parallel = TensorParallelGroup(self.path, config.tensor_parallel_size, config.backend,
                                                       config.activations, threads=config.threads)  # per rank
            self.model = self.tensor_parallel.model  # rank 0's shard
        elif config.device == "cuda":
            from minillm.model.device import to_device

            self.model = to_device(load_model(self.path, backend="reference"))  # the host copy is dropped
        else:
            if config.threads is not None:  # Numba's pool is the process's: the last LLM built sets its size
                import numba

                numba.set_num_threads(min(config.threads, numba.config.NUMBA_NUM_THREADS))
            self.model = load_model(self.path, backend=config.backend, activations=config.activations)
        try:
            self.tokenizer = load_tokenizer(self.path)
            self.engine = LLMEngine(self.model, self.tokenizer, config, tensor_parallel=self.tensor_parallel)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any (also done when the LLM is garbage-collected)."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()

    def encode_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt, all batched together by the engine; outputs in input order."""
        params = params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        encoded = [self.encode_prompt(p) for p in prompts]
        engine = self.engine
        ids = [engine.add_request(token_ids, params) for _, token_ids in encoded]
        pending, generated = set(ids), 0
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while pending:
                step = engine.step()
                generated += len(step)
                done = {o.request_id for o in step if o.request_finished}
                pending -= done
                bar.update(len(done))
                bar.set_postfix_str(f"{generated / max(bar.format_dict['elapsed'], 1e-9):.1f} tok/s", refresh=False)
        return [RequestOutput(text, token_ids, engine.pop_request(i).outputs)
                for (text, token_ids), i in zip(encoded, ids)]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Text pieces of one completion as the engine makes them (every ``SamplingParams`` field as in
        ``generate``, except ``n``: one stream is one completion, so ``n > 1`` is refused - use
        ``generate`` for several). Leaving the loop early aborts the request and frees its blocks."""
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"stream yields one completion, but n = {params.n}: use generate() for n > 1")
        _, ids = self.encode_prompt(prompt)
        self.engine.check_request(ids, params)  # a bad request fails here, not at the first next()
        return self._stream(ids, params)

    def _stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[str]:
        engine = self.engine
        request_id, finished = engine.add_request(prompt_ids, params), False
        try:
            while not finished:
                for out in engine.step():
                    if out.request_id == request_id:
                        finished = out.request_finished
                        if out.text_delta:
                            yield out.text_delta
            engine.pop_request(request_id)
        finally:
            if not finished:  # the caller stopped early (break, Ctrl-C): free the blocks now
                engine.abort(request_id)

    def chat_prompt(self, messages: Sequence[dict], max_tokens: int | None = None) -> list[int]:
        """``chat_prompt`` with this model's tokenizer."""
        return chat_prompt(self.tokenizer, messages, max_tokens)

    def chat(self, messages: Sequence[dict], params: SamplingParams | None = None) -> RequestOutput:
        """The assistant's reply to a conversation."""
        return self.generate([self.chat_prompt(messages)], params, use_tqdm=False)[0]
