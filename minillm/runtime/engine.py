"""``LLMEngine``: requests in, one batched step at a time, text out.

    engine.add_request(prompt_ids, params)       # any time, from any caller (RequestRejected if it can't run)
    while engine.has_unfinished():
        for out in engine.step():                 # schedule -> execute -> update -> propose drafts
            print(out.request_id, out.text_delta)
    engine.stats()                                # running, waiting, KV usage, cache hits, limits

A step: the scheduler plans it (every running sequence's tokens to compute - prompt chunks, decode
tokens, drafts to verify, forced tokens - within the budget, with their KV slots); the model runner
packs the plan into one flat forward over the paged KV cache and chooses the tokens (a draw per
sequence whose newest token ran, a verify per draft); the scheduler's ``update_from_output``
appends them - each through the sequence's output builder, which turns it into text and decides
whether the sequence is done - rolls back rejected drafts, applies forced tokens and frees finished
sequences; then the drafters propose the next step's drafts.

This file is the runtime's whole contract with the layers above it: ``add_request``, ``abort``,
``step`` (whose ``StepOutput``s say everything a caller needs about each token), ``has_unfinished``,
``pop_request``, ``stats`` and ``observe``. ``LLM``, the command line and the server use nothing else.
"""
from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minillm.generation.constrained import TokenIndex, constraint_index, min_tokens_problem, new_guide
from minillm.generation.constrained.grammar_mask import GrammarIndex
from minillm.generation.output import CompletionOutput, OutputBuilder
from minillm.generation.sampling import Sampler, SamplingParams, TokenLogprobs
from minillm.generation.tokenizer import Tokenizer
from minillm.model.transformer import Model
from minillm.runtime.block_manager import BlockManager
from minillm.runtime.config import EngineConfig, EngineLimits
from minillm.runtime.errors import CONTEXT_LENGTH_EXCEEDED, RequestRejected
from minillm.runtime.model_runner import ModelRunner
from minillm.runtime.paged_cache import bytes_per_token
from minillm.runtime.scheduler import Scheduler, SchedulerOutput
from minillm.runtime.speculative import SpeculativeConfig, SpeculativeDecoder
from minillm.runtime.sequence import Sequence, SequenceTimes

if TYPE_CHECKING:  # torch loads only when a group is started
    from minillm.runtime.tensor_parallel import TensorParallelGroup

FINISH_ABORT = "abort"
FINISH_ERROR = "error"   # the sequence alone could not go on (its constraint left no token): StepOutput.error says why

KV_CACHE_CAP = 4 << 30       # the default KV budget never exceeds this (vLLM's CPU backend default)
KV_CACHE_SHARE = 4           # ... nor 1/4 of the memory available when the engine starts


def default_kv_cache_bytes(available: int | None = None) -> int:
    """The KV budget when none is given: min(4 GiB, a quarter of the available memory).

    A fixed small budget (this used to be 256 MB) holds a single full SmolLM2 context, so two long
    requests took the whole cache and every other client waited. A quarter of what is free leaves
    the model, the activations and the rest of the machine their room. ``available``: bytes
    (default: Linux's MemAvailable; elsewhere the cap alone)."""
    if available is None:
        available = memory_available()
    return KV_CACHE_CAP if available is None else min(KV_CACHE_CAP, available // KV_CACHE_SHARE)


def memory_available() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024   # the file counts kB
    except OSError:
        pass
    return None


@dataclass
class StepOutput:
    """What one step produced for one sequence of a request: everything a caller needs to stream it."""
    request_id: str
    index: int                       # which of the request's n completions
    token_id: int
    text_delta: str                  # new text, safe to stream (may be "")
    logprobs: TokenLogprobs | None   # when the request asked for logprobs
    first_token: bool                # the request's first token (of all its completions): its TTFT
    finished: bool                   # this completion is done
    finish_reason: str | None
    request_finished: bool           # all n completions are done: pop_request may take it
    error: str | None = None         # finish_reason FINISH_ERROR: why (token_id is then -1, no token was drawn)


@dataclass(frozen=True)
class PlannedSeq:
    """One sequence of a step's batch, as the scheduler planned it (before the forward ran)."""
    request_id: str
    index: int
    seq_id: int
    num_new: int      # tokens of it that run in this step, draft tokens included
    is_prefill: bool  # more than its newest token and draft: a prompt chunk, a recompute, forced tokens


@dataclass(frozen=True)
class StepPlan:
    """A step's schedule for observers: who ran, who was preempted, who still waits, free blocks."""
    scheduled: list[PlannedSeq]
    preempted: list[int]    # seq ids preempted to make room (their blocks freed, to recompute)
    waiting: list[int]      # seq ids left waiting after admission, in queue order
    num_free_blocks: int    # after this step's allocations


@dataclass(frozen=True)
class EngineStats:
    """One snapshot of the engine: load, KV cache, cumulative counters and the limits it enforces."""
    num_running: int
    num_waiting: int
    num_prefill_tokens: int        # prompt tokens not yet computed, waiting and running sequences together
    kv_cache_usage: float          # fraction of KV blocks in use, 0..1
    num_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int      # cumulative: prompt tokens looked up in the prefix cache
    prefix_cache_hits: int         # cumulative: of those, tokens found there (their prefill skipped)
    num_preemptions: int           # cumulative
    max_model_len: int             # the longest sequence (prompt + completion) a request may ask for
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    # speculative decoding, cumulative (vLLM's spec_decode_* counters); zero without speculation
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()  # (k,) accepted at each draft position


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    builders: list[OutputBuilder]  # one per sequence: its text, logprobs and finish decision

    @property
    def outputs(self) -> list[CompletionOutput]:
        return [b.output for b in self.builders]

    @property
    def times(self) -> list[SequenceTimes]:
        return [s.times for s in self.seqs]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


StepObserver = Callable[[StepPlan, list[StepOutput]], None]


class LLMEngine:
    """A model, a tokenizer, a paged KV cache of ``kv_cache_bytes`` and a continuous-batching scheduler."""

    def __init__(self, model: Model, tokenizer: Tokenizer, config: EngineConfig | None = None,
                 tensor_parallel: TensorParallelGroup | None = None, **options):
        """``config``: the engine's fields of an ``EngineConfig`` (``options``, its field names, replace
        them: ``LLMEngine(model, tokenizer, max_num_seqs=4)``). ``jump_forward``: append the tokens a
        structured-output constraint forces without a forward each. ``kv_cache_bytes`` None:
        ``default_kv_cache_bytes()``. ``max_n``: the most completions one request may ask for (None:
        ``max_num_seqs``, since a request's n sequences run side by side). ``max_model_len``: a shorter
        limit on prompt + completion than the context and the KV cache allow. ``tensor_parallel``: the
        group whose rank 0 ``model`` is (its shard); ``kv_cache_bytes`` is then each rank's budget."""
        self.config = c = EngineConfig.create(config, **options)
        kv_cache_bytes, block_size, max_num_seqs = c.kv_cache_bytes, c.block_size, c.max_num_seqs
        max_num_batched_tokens, jump_forward, speculative = c.max_num_batched_tokens, c.jump_forward, c.speculative
        max_n, max_model_len = c.max_n, c.max_model_len
        if max_n is not None and max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {max_n}")
        self.model, self.tokenizer = model, tokenizer
        self.jump_forward = jump_forward
        kv_cache_bytes = default_kv_cache_bytes() if kv_cache_bytes is None else kv_cache_bytes
        self.block_manager = BlockManager.from_memory_budget(kv_cache_bytes, bytes_per_token(model.config), block_size)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens)
        self.max_n = min(max_num_seqs, max_n or max_num_seqs)
        self.sampler = Sampler(eos_token_ids=[] if tokenizer.eos_id is None else [tokenizer.eos_id])
        self.runner = (ModelRunner(model, self.block_manager, self.sampler) if tensor_parallel is None
                       else tensor_parallel.runner(self.block_manager, self.sampler))
        # The longest sequence one request may ask for: the context, or the whole KV cache if smaller.
        longest = min(model.config.context_length, self.block_manager.num_blocks * block_size)
        if max_model_len is not None and not 1 <= max_model_len <= longest:
            raise ValueError(f"max_model_len must be in [1, {longest}] (the context this model and KV cache hold), "
                             f"got {max_model_len}")
        self.max_model_len = longest if max_model_len is None else max_model_len
        self.limits = EngineLimits(self.max_model_len, self.max_n, max_num_seqs, block_size, tokenizer.vocab_size)
        # speculative: vLLM's speculative_config, e.g. {"method": "ngram", "num_speculative_tokens": 4}
        self.speculative = None if speculative is None else SpeculativeDecoder(
            SpeculativeConfig.from_dict(speculative), model.config.n_layers, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self.observers: list[StepObserver] = []
        self.seq_ids = itertools.count()
        self.request_ids = itertools.count()

    # ---- requests in ------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    arrival: float | None = None, index: TokenIndex | GrammarIndex | None = None) -> str:
        """Queue a request; a request that cannot run is refused here (``RequestRejected``). ``index``:
        its constraint's token index, compiled already by ``constraint_index`` (the server compiles
        off the engine thread); None: compiled here, if the request has a constraint."""
        prompt_ids = [int(t) for t in prompt_ids]
        self.check_request(prompt_ids, params)
        request_id = str(next(self.request_ids)) if request_id is None else request_id
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        arrival = time.perf_counter() if arrival is None else arrival
        index = self.constraint_index(params) if index is None else index
        if index is not None and not params.ignore_eos and (
                problem := min_tokens_problem(index, params.min_tokens, self.max_model_len - len(prompt_ids))):
            raise RequestRejected(problem, "min_tokens")
        seqs = [Sequence(next(self.seq_ids), request_id, prompt_ids, params, choice=i, arrival=arrival,
                         guide=None if index is None else new_guide(index, params.max_tokens),
                         jump_forward=self.jump_forward)
                for i in range(params.n)]
        seqs[0].forks = seqs[1:]  # they fork its blocks once the prompt is cached
        builders = [OutputBuilder(self.tokenizer, params, len(prompt_ids), self.max_model_len, index=i)
                    for i in range(params.n)]
        self.requests[request_id] = Request(request_id, prompt_ids, params, seqs, builders)
        self.scheduler.add(seqs[0])
        return request_id

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Every check of a request against this engine's limits, each naming the request field at fault."""
        self.check_params(params)
        if not prompt_ids:
            raise RequestRejected("prompt is empty: give at least one token", "prompt")
        self.limits.check_vocabulary(prompt_ids, "prompt")
        limit, prompt_len = self.max_model_len, len(prompt_ids)
        if prompt_len >= limit:
            raise RequestRejected(f"This model's maximum context length is {limit} tokens. However, your prompt "
                                  f"has {prompt_len} tokens, leaving no room for a completion. Please shorten the "
                                  f"prompt.", "prompt", CONTEXT_LENGTH_EXCEEDED)
        if params.max_tokens is not None and prompt_len + params.max_tokens > limit:
            raise RequestRejected(f"This model's maximum context length is {limit} tokens. However, you requested "
                                  f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the prompt, "
                                  f"{params.max_tokens} in the completion). Please reduce the length of the prompt "
                                  f"or completion.", "max_tokens", CONTEXT_LENGTH_EXCEEDED)

    def check_params(self, params: SamplingParams) -> None:
        """The checks that need no prompt (``EngineLimits.check_params``). A caller may run them before
        it tokenizes anything (the server does), so that a request asking for too much costs nothing:
        they read only limits fixed when the engine was built, which makes them safe from any thread."""
        self.limits.check_params(params)

    def constraint_index(self, params: SamplingParams) -> TokenIndex | GrammarIndex | None:
        """The structured-output index of the request's constraint (None: it has none), compiled within
        the default compile budget and cached; one the engine cannot honour -> ``RequestRejected``
        naming the field. It reads only the tokenizer and the (locked) index cache: safe from any thread."""
        if params.guided_pattern is None:
            return None
        try:
            return constraint_index(params.guided_pattern, self.tokenizer)
        except ValueError as e:   # ConstraintTooLarge naming its bound, RegexError, SchemaError
            raise RequestRejected(f"{params.constraint_field}: {e}", params.constraint_field) from None

    def abort(self, request_id: str) -> None:
        """Stop a request in whatever state it is; its blocks return to the pool."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq, builder in zip(request.seqs, request.builders):
            if not seq.finished:
                self.scheduler.finish(seq)
                builder.output.finish_reason = FINISH_ABORT

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def pop_request(self, request_id: str) -> Request:
        """Hand over a finished request (its outputs and timings) and forget it."""
        request = self.requests[request_id]
        if not request.finished:
            raise ValueError(f"request {request_id!r} has not finished")
        return self.requests.pop(request_id)

    # ---- one step ---------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """schedule -> execute -> update -> propose drafts: one forward, every sequence it advanced."""
        start = time.perf_counter()  # the drafters weigh drafts against measured step times
        plan = self.scheduler.schedule()
        record = self._record(plan) if self.observers else None
        outputs = []
        if plan.scheduled:
            output = self.runner.execute(plan)
            outputs = self.scheduler.update_from_output(plan, output, self._emit)
            outputs += [self._fail(seq, output.errors[seq.seq_id]) for seq in plan.sequences_in(output.errors)]
        if self.speculative is not None:
            self.speculative.propose(plan, self.scheduler, self.runner, time.perf_counter() - start)
        for observer in list(self.observers):
            observer(record, outputs)
        return outputs

    def observe(self, observer: StepObserver) -> Callable[[], None]:
        """Call ``observer(plan, outputs)`` after every step; returns the function that stops it."""
        self.observers.append(observer)
        return functools.partial(self.observers.remove, observer)

    def _emit(self, seq: Sequence, token_id: int, logprobs: TokenLogprobs | None) -> StepOutput:
        """A token the scheduler appended to ``seq``: its text, its times, whether it ends the sequence."""
        request = self.requests[seq.request_id]
        builder = request.builders[seq.choice]
        first = not any(b.output.token_ids for b in request.builders)
        delta = builder.append(token_id, logprobs)
        now = time.perf_counter()
        seq.times.first_token = seq.times.first_token or now
        seq.times.tokens.append(now)
        if builder.finished:
            seq.times.finished = now
        return StepOutput(seq.request_id, seq.choice, token_id, delta, logprobs, first, builder.finished,
                          builder.output.finish_reason, all(b.finished for b in request.builders))

    def _fail(self, seq: Sequence, message: str) -> StepOutput:
        """The StepOutput of a sequence no token could continue (the scheduler has finished it):
        FINISH_ERROR and no token, its request alone told why."""
        request = self.requests[seq.request_id]
        request.builders[seq.choice].output.finish_reason = FINISH_ERROR
        seq.times.finished = time.perf_counter()
        return StepOutput(seq.request_id, seq.choice, -1, "", None, False, True, FINISH_ERROR, request.finished,
                          error=message)

    def _record(self, plan: SchedulerOutput) -> StepPlan:
        """The plan as plain facts, taken before the forward moves the sequences on."""
        scheduled = [PlannedSeq(s.seq.request_id, s.seq.choice, s.seq.seq_id, s.num_new,
                                s.num_new - len(s.draft) > 1 or not s.seq.output_ids) for s in plan.scheduled]
        return StepPlan(scheduled, [s.seq_id for s in plan.preempted], [s.seq_id for s in self.scheduler.waiting],
                        self.block_manager.num_free_blocks)

    # ---- usage figures ------------------------------------------------------------------

    def commit_kv_cache(self) -> int:
        """Make the whole KV budget resident now (``PagedKVCache.commit``) -> its bytes. A server's
        choice, as vLLM's: its memory is then what it will be under any load, from the start, and
        never grows with traffic. (Tensor-parallel ranks 1.. keep their caches lazy.)"""
        cache = self.runner.cache
        cache.commit()
        return cache.k.nbytes + cache.v.nbytes

    def stats(self) -> EngineStats:
        bm, scheduler = self.block_manager, self.scheduler
        spec = {} if self.speculative is None else dict(
            spec_decode_num_drafts=self.speculative.stats.num_drafts,
            spec_decode_num_draft_tokens=self.speculative.stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.speculative.stats.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(self.speculative.stats.accepted_per_pos))
        prefill_tokens = sum(seq.num_uncomputed for seq in (*scheduler.waiting, *scheduler.running)
                             if seq.num_uncomputed > 1 or not seq.output_ids)
        return EngineStats(
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            num_prefill_tokens=prefill_tokens, kv_cache_usage=bm.usage,
            num_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks,
            prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=scheduler.num_preemptions, max_model_len=self.max_model_len,
            max_num_seqs=scheduler.max_num_seqs, max_num_batched_tokens=scheduler.max_num_batched_tokens,
            block_size=bm.block_size, **spec)
