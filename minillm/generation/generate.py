"""The autoregressive loop: one request, one contiguous KV cache, one token per step.

LLM inference is a state machine, not one forward:

    PREFILL   run the whole prompt through the model once, filling the KV cache; sample token 1
    DECODE    run only the newest token, attending to everything cached; sample the next token
    FINISHED  eos, a stop token or string, max_tokens, or a full context

Prefill is one big matmul per weight (compute-bound); each decode step reads every weight to
produce one token (memory-bound). The KV cache is what makes a decode step cost O(1) forwards
instead of re-running the whole sequence.

``prefill`` and ``decode_step`` are the two forwards; ``Generation`` is the state machine around
them, with sampling and the output (text, stop conditions) of one request.
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from minillm.generation.output import CompletionOutput, OutputBuilder
from minillm.generation.sampling import Sampler, SamplingParams, SamplingState
from minillm.generation.tokenizer import Tokenizer
from minillm.model.kv_cache import AttentionMetadata, KVCache
from minillm.model.transformer import Model

PREFILL, DECODE, FINISHED = "prefill", "decode", "finished"


@dataclass
class Timings:
    """Seconds: time to first token, time per output token after the first, end to end."""
    ttft_s: float
    tpot_s: float | None  # None with a single output token
    e2e_s: float


def check_prompt_fits(prompt_len: int, context_length: int) -> None:
    """Refuse, before any compute, a prompt that leaves no room for one new token."""
    if prompt_len == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if prompt_len >= context_length:
        raise ValueError(f"the prompt has {prompt_len} tokens but the model's context holds {context_length}: "
                         f"no room to generate (shorten the prompt to at most {context_length - 1} tokens)")


# -----------------------------------------------------------------------------------------------
# The two forwards of the loop: the whole prompt once, then one token at a time

def prefill(model: Model, cache: KVCache, prompt_ids: Sequence[int], slot: int = 0) -> np.ndarray:
    """Run the whole prompt through the model into an empty cache slot -> the next token's logits (V,)."""
    ids = np.asarray(prompt_ids, dtype=np.int64)                       # (T,)
    meta = AttentionMetadata(query_lens=[len(ids)], context_lens=[0], seq_slots=[slot])
    logits = model.forward(ids, meta, cache)                           # (1, V) only the last row
    return logits[0]                                                   # (V,)


def decode_step(model: Model, cache: KVCache, token_id: int, position: int, slot: int = 0) -> np.ndarray:
    """One token at ``position`` through the model, attending to the ``position`` tokens cached
    before it in ``slot`` (and adding its own K/V there) -> the next token's logits (V,).

    This is all a decode step computes: one row of every matmul, one query per attention head.
    Without the cache it would have to re-run all position + 1 tokens.
    """
    meta = AttentionMetadata(query_lens=[1], context_lens=[position], seq_slots=[slot])
    logits = model.forward(np.array([token_id]), meta, cache)          # (1, V)
    return logits[0]                                                   # (V,)


class Generation:
    """One request stepping through PREFILL -> DECODE ... -> FINISHED; ``step`` returns new text."""

    def __init__(self, model: Model, tokenizer: Tokenizer, prompt_ids: Sequence[int],
                 params: SamplingParams, choice: int = 0):
        context = model.config.context_length
        check_prompt_fits(len(prompt_ids), context)
        self.model, self.params = model, params
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.builder = OutputBuilder(tokenizer, params, len(self.prompt_ids), context, index=choice)
        most_tokens = len(self.prompt_ids) + (params.max_tokens or context)
        self.cache = model.new_cache(n_slots=1, max_len=min(context, most_tokens))
        self.sampler = Sampler(eos_token_ids=[] if tokenizer.eos_id is None else [tokenizer.eos_id])
        self.sampling = SamplingState(params, self.prompt_ids, self.builder.output.token_ids, choice=choice)
        self.state = PREFILL
        self.start = time.perf_counter()
        self.token_times: list[float] = []

    @property
    def output(self) -> CompletionOutput:
        return self.builder.output

    def step(self) -> str:
        """One forward and one sampled token; the text it completes (often '' mid-character)."""
        if self.state == FINISHED:
            raise RuntimeError("the generation has finished")
        if self.state == PREFILL:
            logits = prefill(self.model, self.cache, self.prompt_ids)          # (V,) the whole prompt at once
        else:
            position = len(self.prompt_ids) + len(self.output.token_ids) - 1  # the newest token's position
            logits = decode_step(self.model, self.cache, self.output.token_ids[-1], position)  # (V,)
        sampled = self.sampler.sample(logits[None], [self.sampling])  # (1, V): a batch of one
        self.token_times.append(time.perf_counter())
        piece = self.builder.append(int(sampled.token_ids[0]), sampled.logprobs[0])
        self.state = FINISHED if self.builder.finished else DECODE
        return piece

    def __iter__(self) -> Iterator[str]:
        """Stream the text: run steps until finished, yielding each non-empty piece."""
        while self.state != FINISHED:
            if piece := self.step():
                yield piece

    def run(self) -> CompletionOutput:
        for _ in self:
            pass
        return self.output

    def timings(self) -> Timings:
        if not self.token_times:
            raise RuntimeError("no token has been generated yet")
        ttft = self.token_times[0] - self.start
        n = len(self.token_times)
        tpot = (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None
        return Timings(ttft_s=ttft, tpot_s=tpot, e2e_s=self.token_times[-1] - self.start)
