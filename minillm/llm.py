"""``minillm.LLM``: the public face - load a model, generate, stream, chat.

    llm = minillm.LLM()                                 # the default model (fetched on first use)
    outs = llm.generate(["Once upon a time"], minillm.SamplingParams(temperature=0, max_tokens=32))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from minillm.generation.chat import render_chat
from minillm.generation.generate import Generation
from minillm.generation.output import CompletionOutput
from minillm.generation.sampling import SamplingParams
from minillm.generation.tokenizer import Tokenizer
from minillm.model.fetch import cached_model_path, fetch
from minillm.model.loader import load_model
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


def load_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer that travels with a model: GGUF metadata, or tokenizer.json in an HF folder."""
    return Tokenizer.from_hf_json(path) if path.is_dir() else Tokenizer.from_gguf(path)


class LLM:
    """A model with its tokenizer, ready to generate."""

    def __init__(self, model: str | Path | None = None, backend: str = "numba", **engine_args):
        """``engine_args`` go to ``LLMEngine``: kv_cache_bytes, block_size, max_num_seqs, max_num_batched_tokens."""
        self.path = Path(model) if model is not None else (cached_model_path() or fetch())
        self.model = load_model(self.path, backend=backend)
        self.tokenizer = load_tokenizer(self.path)
        self.engine = LLMEngine(self.model, self.tokenizer, **engine_args)

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
                done = {o.request_id for o in step if o.finished and engine.requests[o.request_id].finished}
                pending -= done
                bar.update(len(done))
                bar.set_postfix_str(f"{generated / max(bar.format_dict['elapsed'], 1e-9):.1f} tok/s", refresh=False)
        return [RequestOutput(text, token_ids, engine.pop_request(i).outputs)
                for (text, token_ids), i in zip(encoded, ids)]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Text pieces as they are generated (one completion)."""
        _, ids = self.encode_prompt(prompt)
        yield from Generation(self.model, self.tokenizer, ids, params or SamplingParams())

    def chat_prompt(self, messages: Sequence[dict]) -> list[int]:
        """The token ids of a conversation rendered with the model's chat template."""
        tok = self.tokenizer
        text = render_chat(messages, tok.chat_template, add_generation_prompt=True,
                           bos_token=tok.bos_token or "", eos_token=tok.eos_token or "")
        return tok.encode(text, add_bos=False)

    def chat(self, messages: Sequence[dict], params: SamplingParams | None = None) -> RequestOutput:
        """The assistant's reply to a conversation."""
        return self.generate([self.chat_prompt(messages)], params, use_tqdm=False)[0]
