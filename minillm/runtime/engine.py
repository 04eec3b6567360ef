"""``LLMEngine``: requests in, one batched step at a time, text out.

    engine.add_request(prompt_ids, params)       # any time, from any caller
    while engine.has_unfinished():
        for out in engine.step():                 # schedule -> batch -> forward -> sample -> detokenize
            print(out.request_id, out.text_delta)

A step: the scheduler picks the batch (decode tokens of running sequences plus prefill chunks of
new ones), the model runner packs it into one flat forward over the paged KV cache, the sampler
draws one token for every sequence whose last token ran, and each sequence's output builder turns
the token into text and decides whether the sequence is done. Finished sequences free their blocks.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from minillm.generation.generate import check_prompt_fits
from minillm.generation.output import CompletionOutput, OutputBuilder
from minillm.generation.sampling import Sampler, SamplingParams
from minillm.generation.tokenizer import Tokenizer
from minillm.model.transformer import Model
from minillm.runtime.block_manager import BlockManager
from minillm.runtime.model_runner import ModelRunner
from minillm.runtime.paged_cache import bytes_per_token
from minillm.runtime.scheduler import Scheduler
from minillm.runtime.sequence import Sequence, Status

FINISH_ABORT = "abort"


@dataclass
class StepOutput:
    """What one step produced for one sequence of a request."""
    request_id: str
    index: int             # which of the request's n completions
    token_id: int
    text_delta: str        # new text, safe to stream (may be "")
    finished: bool
    finish_reason: str | None


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]

    @property
    def outputs(self) -> list[CompletionOutput]:
        return [s.builder.output for s in self.seqs]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


class LLMEngine:
    """A model, a tokenizer, a paged KV cache of ``kv_cache_bytes`` and a continuous-batching scheduler."""

    def __init__(self, model: Model, tokenizer: Tokenizer, kv_cache_bytes: int = 256 << 20,
                 block_size: int = 16, max_num_seqs: int = 32, max_num_batched_tokens: int = 512):
        self.model, self.tokenizer = model, tokenizer
        self.block_manager = BlockManager.from_memory_budget(kv_cache_bytes, bytes_per_token(model.config), block_size)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens)
        self.runner = ModelRunner(model, self.block_manager)
        self.sampler = Sampler(eos_token_ids=[] if tokenizer.eos_id is None else [tokenizer.eos_id])
        self.requests: dict[str, Request] = {}
        self.seq_ids = itertools.count()
        self.request_ids = itertools.count()

    # ---- requests in ------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    arrival: float | None = None) -> str:
        """Queue a request; bad input fails here, before it touches the scheduler."""
        context = self.model.config.context_length
        check_prompt_fits(len(prompt_ids), context)
        if params.n > self.scheduler.max_num_seqs:
            raise ValueError(f"n = {params.n} exceeds max_num_seqs = {self.scheduler.max_num_seqs}")
        longest = min(context, len(prompt_ids) + (params.max_tokens or context))
        if self.block_manager.num_blocks_for(longest) > self.block_manager.num_blocks:
            raise ValueError(f"a sequence of {longest} tokens needs more KV blocks than the whole cache holds "
                             f"({self.block_manager.num_blocks} blocks of {self.block_manager.block_size})")
        request_id = str(next(self.request_ids)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = [int(t) for t in prompt_ids]
        arrival = time.perf_counter() if arrival is None else arrival
        seqs = [Sequence(next(self.seq_ids), request_id, prompt_ids, params,
                         OutputBuilder(self.tokenizer, params, len(prompt_ids), context, index=i), choice=i,
                         arrival=arrival)
                for i in range(params.n)]
        self.requests[request_id] = Request(request_id, prompt_ids, params, seqs)
        self.scheduler.add(seqs[0])  # the others fork its blocks once the prompt is cached
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request in whatever state it is; its blocks return to the pool."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.finished:
                self.scheduler.finish(seq)
                seq.builder.output.finish_reason = FINISH_ABORT

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def pop_request(self, request_id: str) -> Request:
        """Hand over a finished request and forget it."""
        request = self.requests[request_id]
        if not request.finished:
            raise ValueError(f"request {request_id!r} has not finished")
        return self.requests.pop(request_id)

    # ---- one step ---------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        now = time.perf_counter()
        for s in plan.scheduled:
            s.seq.times.first_scheduled = s.seq.times.first_scheduled or now
        logits = self.runner.run(plan.scheduled, plan.copies)                  # (S, V)
        sampling = [s.seq for s in plan.scheduled if s.completes_prefill]     # (S,) in logits row order
        self.scheduler.computed(plan.scheduled)
        rows, states = [], []
        for row, seq in enumerate(sampling):
            for member in self._forks_due(seq):                               # n > 1: siblings share row
                rows.append(row)
                states.append(member)
            rows.append(row)
            states.append(seq)
        if not states:
            return []
        result = self.sampler.sample(logits[rows], [s.sampling for s in states])
        now = time.perf_counter()
        return [self._append(seq, int(tok), lp, now)
                for seq, tok, lp in zip(states, result.token_ids, result.logprobs)]

    def _forks_due(self, seq: Sequence) -> list[Sequence]:
        """Siblings of a request's first sequence join when its prompt prefill completes."""
        request = self.requests[seq.request_id]
        if seq is not request.seqs[0] or seq.output_ids or len(request.seqs) == 1:
            return []
        for sibling in request.seqs[1:]:
            self.scheduler.fork(seq, sibling)
        return request.seqs[1:]

    def _append(self, seq: Sequence, token_id: int, logprobs, now: float) -> StepOutput:
        delta = seq.builder.append(token_id, logprobs)
        seq.times.first_token = seq.times.first_token or now
        seq.times.tokens.append(now)
        if seq.builder.finished:
            self.scheduler.finish(seq)
            seq.times.finished = now
        out = seq.builder.output
        return StepOutput(seq.request_id, seq.choice, token_id, delta, seq.finished, out.finish_reason)

    # ---- usage figures ------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)
