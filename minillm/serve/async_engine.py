"""The engine thread: one ``LLMEngine`` stepping in the background, many HTTP requests around it.

The engine is not thread-safe, and a step is long (tens of milliseconds to seconds on a CPU), so
it lives in a thread of its own and nothing else touches it. Requests reach it as commands; tokens
come back through one ``asyncio.Queue`` per request:

    event loop (HTTP handlers)                          engine thread
    --------------------------                          -------------
    submit(prompt, params)
      constraint -> token index in the compile thread
                      ---- Add ----> commands ---> engine.add_request (RequestRejected -> 400)
                                                        while work exists:
                                                            run the commands that came in
                                                            engine.step()
    async for deltas in stream <-- asyncio.Queue <----- loop.call_soon_threadsafe(queue.put_nowait, ...)
    client gone: stream.close() -- Abort --> commands --> engine.abort (its KV blocks are freed)

``call_soon_threadsafe`` is the only safe way into the event loop from another thread: it queues
the ``put_nowait`` call and wakes the loop. With no work the thread sleeps on a condition
variable, so an idle server costs nothing.

A constraint (``guided_*``, ``response_format``, tools) is compiled to its token index before the
request reaches the engine, in a thread of its own (one: a compile is CPU work, two at once would
only share the same cores), within the compile budget (a 400 naming the bound past it). On the
engine thread a compile of a second stalled every stream. In the compile thread it shares the GIL
with the engine thread, which Python hands over every few milliseconds, and the index's trie walk
(most of a compile) runs without it. It still shares the cores: on two of them, a walk beside the
engine's two kernel threads added seconds to a two-token request, so the compile thread runs at
the lowest priority (nice 19) and gets the cores the engine leaves. The price: while the thread
holds the GIL in a Python stage (parsing, subset construction: each bounded by the budget), a
busy machine can keep it waiting for a core, and the engine thread waits for the GIL with it.

Back-pressure: requests accepted but not yet running are counted; past ``max_waiting`` a new
request gets a 503 at once, instead of a queue that grows without bound while every client waits
longer. The count is the load the engine will see - its waiting queue, the adds still in the
command list, the requests on probation - less the free places among its ``max_num_seqs``: an add
that will start running at once is not waiting (a burst of requests is not refused while the
engine still has room for them).

Requests are not all alike: one 2,000-token prompt is as much prefill as a thousand "Hi"s. So
past ``max_queued_tokens`` prompt tokens still to prefill (the engine's waiting and running
prefills, as of the last step, plus the adds since) a new request also gets a 503 - unless nothing
is queued at all, so that any prompt the context holds can always run. Without it, a client that
sends forty long prompts takes every running place for minutes, and each short request behind
them waits as long.

A failing request must not take the others with it. A step runs many requests in one batch, so
when it raises, the thread cannot see whose data broke it; it narrows it down instead. Requests
that have produced no token yet ("newcomers") are taken out of the engine (their clients have
seen nothing, so nothing is lost) and readmitted one per step. A step that fails while a
readmitted request is the only newcomer is that request's fault: it alone gets the error (a 500).
A step that fails with no newcomer in flight fails every request in flight, as before: the fault
is in the engine, not in one request. Either way the thread lives on and keeps serving. A
sequence the engine itself ends with ``FINISH_ERROR`` (its constraint left no token to draw) is
known to be its request's fault: that request alone gets the error (``RequestFailed``, a 400).
(A step that raised after some of its tokens were appended loses those tokens; the retry starts
from the next step.) A request older than ``request_timeout`` seconds is aborted with a 504.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from minillm.generation.constrained import TokenIndex
from minillm.generation.sampling import SamplingParams
from minillm.runtime.engine import FINISH_ERROR, EngineStats, LLMEngine, StepOutput
from minillm.runtime.errors import RequestRejected
from minillm.serve.client import ACCEPTED, SHUTTING_DOWN, EngineFailure, RequestStream, RequestTimedOut
from minillm.serve.errors import APIError
from minillm.serve.metrics import ServerMetrics, StatsLogger

log = logging.getLogger("minillm.serve")

COMPILE_NICE = 19      # the compile thread's nice value: the lowest priority


class RequestFailed(EngineFailure):
    """The engine ended one of the request's sequences with an error of the request's own making
    (``FINISH_ERROR``: its constraint left no token); the other requests run on."""
    status = 400


@dataclass
class Add:
    stream: RequestStream
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    index: TokenIndex | None = None   # the constraint's token index, compiled off the engine thread


@dataclass
class Abort:
    request_id: str


def lower_priority() -> None:
    """The calling thread yields the cores to every other thread of normal priority (Linux: a
    thread has its own nice value). The compile thread calls it: the engine's step wins."""
    if hasattr(os, "setpriority"):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)


class AsyncEngine:
    """An ``EngineClient`` (``client.py``): one ``LLMEngine`` in a thread of its own (module docstring)."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_waiting: int = 128,
                 log_interval: float = 10.0, request_timeout: float | None = None,
                 max_request_tokens: int | None = None, max_queued_tokens: int | None = None):
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        if request_timeout is not None and request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {request_timeout}")
        if max_request_tokens is not None and max_request_tokens < 1:
            raise ValueError(f"max_request_tokens must be >= 1, got {max_request_tokens}")
        if max_queued_tokens is not None and max_queued_tokens < 1:
            raise ValueError(f"max_queued_tokens must be >= 1, got {max_queued_tokens}")
        self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
        self.request_timeout, self.max_request_tokens = request_timeout, max_request_tokens
        self.max_queued_tokens = max_queued_tokens
        self.max_model_len = engine.stats().max_model_len
        # engine thread only: failure isolation (module docstring)
        self.newcomers: dict[str, Add] = {}     # in the engine, no token out yet
        self.probation: deque[Add] = deque()    # taken out after a failed step; readmitted one per step
        self.on_probation: str | None = None    # the readmitted request now running alone as a newcomer
        self.arrivals: dict[str, float] = {}    # request id -> arrival (perf_counter), for the timeout
        self.on_death: Callable[[], None] | None = None  # called if the thread dies after all
        self.stats_logger = StatsLogger(log_interval)
        self.wakeup = threading.Condition()
        self.commands: list[Add | Abort] = []   # guarded by wakeup
        self.num_waiting = 0                    # guarded by wakeup: the load beyond the free places (docstring)
        self.queued = 0                         # guarded by wakeup: scheduler waiting + probation, last step
        self.queued_tokens = 0                  # guarded by wakeup: prompt tokens to prefill, last step + adds since
        self.prefill_tokens = 0                 # guarded by wakeup: the engine's and probation's, last step
        self.free_places = engine.stats().max_num_seqs  # guarded by wakeup: max_num_seqs - running, last step
        self.stopping = False                   # guarded by wakeup
        self.streams: dict[str, RequestStream] = {}  # engine thread only
        self.thread = threading.Thread(target=self.run, name="minillm-engine", daemon=True)
        self.compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minillm-compile",
                                           initializer=lower_priority)

    # ---- the event loop's side -----------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Abort whatever is still in flight (its clients get an error event) and end the thread."""
        with self.wakeup:
            self.stopping = True
            self.wakeup.notify()
        self.compiler.shutdown(wait=False, cancel_futures=True)
        self.thread.join()

    @property
    def alive(self) -> bool:
        """Taking requests: started, not stopping, not dead."""
        return self.thread.is_alive() and not self.stopping

    async def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                     arrival: float) -> RequestStream:
        """Queue a request; returns once the engine has accepted it. Raises the engine's RequestRejected,
        or an APIError (503) when the server cannot take it."""
        if self.max_request_tokens is not None:  # no max_tokens: up to the end of the context
            budget = params.n * (params.max_tokens or max(self.max_model_len - len(prompt_ids), 0))
            if budget > self.max_request_tokens:
                raise RequestRejected(f"n x max_tokens = {params.n} x {budget // params.n} = {budget} tokens exceeds "
                                      f"this server's limit per request ({self.max_request_tokens}); lower n or "
                                      f"max_tokens", "max_tokens")
        index = await self.compiled(params)
        stream = RequestStream(request_id, params.n, len(prompt_ids), self.abort)
        with self.wakeup:
            if not self.alive:
                raise APIError(503, "the engine is not running (the server is shutting down)")
            if self.num_waiting >= self.max_waiting:
                raise APIError(503, f"the server is overloaded: {self.num_waiting} requests are already waiting "
                                    f"(max_waiting = {self.max_waiting}); retry later")
            if (self.max_queued_tokens is not None and self.queued_tokens
                    and self.queued_tokens + len(prompt_ids) > self.max_queued_tokens):
                raise APIError(503, f"the server is overloaded: {self.queued_tokens} prompt tokens are already "
                                    f"waiting to be prefilled (max_queued_tokens = {self.max_queued_tokens}); "
                                    f"retry later")
            self.commands.append(Add(stream, prompt_ids, params, arrival, index))
            self.count_waiting()
            self.wakeup.notify()
        try:
            await stream.accepted()
        except asyncio.CancelledError:  # the client left before the engine got to it
            stream.close()
            raise
        return stream

    async def compiled(self, params: SamplingParams) -> TokenIndex | None:
        """The request's constraint as a token index, compiled in the compile thread (from the index
        cache if it was compiled before); RequestRejected naming the field if it cannot be."""
        if params.guided_pattern is None:
            return None
        return await asyncio.get_running_loop().run_in_executor(self.compiler, self.engine.constraint_index, params)

    def check_params(self, params: SamplingParams) -> None:
        """The engine's checks that need no prompt (``LLMEngine.check_params``: fixed limits only, so
        safe from the event loop), for a handler to run before it does any work for the request."""
        self.engine.check_params(params)

    async def stats(self) -> list[EngineStats]:
        """The engine's snapshot after its latest step (the engine thread hands it to the metrics)."""
        return [self.metrics.engine_stats.stats]

    def count_waiting(self) -> None:
        """Under ``wakeup``: the requests that will wait, from the last step's figures and the adds since."""
        adds = [c for c in self.commands if isinstance(c, Add)]
        self.num_waiting = max(self.queued + len(adds) - self.free_places, 0)
        self.queued_tokens = self.prefill_tokens + sum(len(c.prompt_ids) for c in adds)

    def abort(self, request_id: str) -> None:
        with self.wakeup:
            self.commands.append(Abort(request_id))
            self.wakeup.notify()

    # ---- the engine thread ---------------------------------------------------------------

    def run(self) -> None:
        try:
            self.serve_forever()
        except Exception:  # a bug outside the step: fail loudly, never leave a client hanging
            log.exception("the engine thread died")
            with self.wakeup:
                self.stopping = True  # new requests get a 503 from now on
                pending, self.commands = self.commands, []
            for command in pending:
                if isinstance(command, Add):
                    command.stream.put(EngineFailure("the engine thread died"))
            self.fail_all("internal error: the engine thread died")
            if self.on_death is not None:  # `minillm serve`: stop the HTTP side too, exit non-zero
                self.on_death()
            raise

    def serve_forever(self) -> None:
        while True:
            with self.wakeup:
                if not (self.commands or self.engine.has_unfinished() or self.stopping or self.probation):
                    self.stats_logger.log(self.engine.stats())  # a burst of work just ended
                    while not (self.commands or self.engine.has_unfinished() or self.stopping):
                        self.wakeup.wait()
                    self.stats_logger.start_window()
                commands, self.commands = self.commands, []
                stopping = self.stopping
            for command in commands:
                self.execute(command)
            if commands:
                self.refresh_load()  # the step may be long: the new requests count from now
            if stopping:
                self.fail_all(SHUTTING_DOWN)
                return
            stepped_cleanly = self.step() if self.engine.has_unfinished() else True
            if stepped_cleanly and self.probation and self.on_probation is None and not self.newcomers:
                self.readmit(self.probation.popleft())
            if self.request_timeout is not None:
                self.expire()
            self.metrics.observe_engine(self.refresh_load())

    def refresh_load(self) -> EngineStats:
        stats = self.engine.stats()
        with self.wakeup:
            self.queued = stats.num_waiting + len(self.probation)
            self.prefill_tokens = stats.num_prefill_tokens + sum(len(c.prompt_ids) for c in self.probation)
            self.free_places = max(stats.max_num_seqs - stats.num_running, 0)
            self.count_waiting()
        return stats

    def execute(self, command: Add | Abort) -> None:
        if isinstance(command, Abort):
            if command.request_id in self.streams:
                self.engine.abort(command.request_id)
                self.forget(command.request_id)
        elif self.probation or self.on_probation is not None:  # a culprit is being sought: newcomers queue
            self.probation.append(command)
        else:
            self.admit(command)

    def admit(self, command: Add) -> bool:
        """Into the engine; the stream hears ACCEPTED (once), the engine's RequestRejected, or a failure."""
        stream, request_id = command.stream, command.stream.request_id
        try:
            self.engine.add_request(command.prompt_ids, command.params, request_id=request_id,
                                    arrival=command.arrival, index=command.index)
        except RequestRejected as e:
            self.forget(request_id)
            stream.put(e)
            return False
        except Exception as e:  # a bug this request alone ran into: it fails, the thread lives on
            log.exception("adding request %s failed", request_id)
            self.engine.abort(request_id)
            self.forget(request_id)
            stream.put(EngineFailure(f"internal error in the engine: {type(e).__name__}: {e}"))
            return False
        self.newcomers[request_id], self.arrivals[request_id] = command, command.arrival
        if request_id not in self.streams:  # a readmitted request was accepted already
            self.streams[request_id] = stream
            stream.put(ACCEPTED)
        return True

    def readmit(self, command: Add) -> None:
        """Back into the engine as the only newcomer: if the next step fails, it is to blame."""
        if not command.stream.done and self.admit(command):  # done: its client left meanwhile
            self.on_probation = command.stream.request_id

    def isolate(self, message: str) -> None:
        """After a failed step: blame the request on probation, else take the newcomers out, else fail all."""
        if self.on_probation is not None:
            self.fail([self.on_probation], message)
        elif self.newcomers:
            for request_id, command in list(self.newcomers.items()):
                self.engine.abort(request_id)  # frees its blocks; its stream stays, it comes back later
                del self.newcomers[request_id]
                self.probation.append(command)
            log.warning("taking %d new request(s) out of the batch to find the one that broke it", len(self.probation))
        else:
            self.fail(list(self.streams), message)

    def expire(self) -> None:
        now = time.perf_counter()
        late = [request_id for request_id, arrival in self.arrivals.items() if now - arrival > self.request_timeout]
        self.fail(late, f"the request took longer than this server's request timeout ({self.request_timeout} s) "
                        f"and was aborted", RequestTimedOut)

    def forget(self, request_id: str) -> None:
        self.streams.pop(request_id, None)
        self.newcomers.pop(request_id, None)
        self.arrivals.pop(request_id, None)
        if self.on_probation == request_id:
            self.on_probation = None

    def fail(self, request_ids: list[str], message: str, error: type[EngineFailure] = EngineFailure) -> None:
        for request_id in request_ids:
            stream = self.streams.get(request_id)
            self.engine.abort(request_id)
            self.forget(request_id)
            if stream is not None:
                stream.put(error(message))

    def step(self) -> bool:
        """One engine step, its tokens sent to their streams; False if it failed (see ``isolate``)."""
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed")
            self.isolate(f"internal error in the engine: {type(e).__name__}: {e}")
            return False
        by_request: dict[str, list[StepOutput]] = defaultdict(list)
        for out in outputs:
            by_request[out.request_id].append(out)
        # prompt tokens of the requests whose first token came out in this step
        num_prompt = sum(self.streams[out.request_id].num_prompt_tokens for out in outputs if out.first_token)
        self.metrics.observe_step(len(outputs), num_prompt)
        self.stats_logger.step(self.engine.stats(), len(outputs), num_prompt)
        for request_id, request_outputs in by_request.items():
            if failed := next((out.error for out in request_outputs if out.finish_reason == FINISH_ERROR), None):
                self.fail([request_id], failed, RequestFailed)   # it alone: its siblings end with it
                continue
            self.streams[request_id].put(request_outputs)
            self.newcomers.pop(request_id, None)  # it has a token out: no longer a suspect
            if self.on_probation == request_id:
                self.on_probation = None
            if request_outputs[-1].request_finished:
                self.metrics.observe_finished(self.engine.pop_request(request_id))
                self.forget(request_id)
        return True

    def fail_all(self, message: str) -> None:
        self.fail(list(self.streams), message)
        while self.probation:  # taken out of the engine, or never in it
            self.probation.popleft().stream.put(EngineFailure(message))
