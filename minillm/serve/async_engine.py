"""The engine thread: one ``LLMEngine`` stepping in the background, many HTTP requests around it.

The engine is not thread-safe, and a step is long (tens of milliseconds to seconds on a CPU), so
it lives in a thread of its own and nothing else touches it. Requests reach it as commands; tokens
come back through one ``asyncio.Queue`` per request:

    event loop (HTTP handlers)                          engine thread
    --------------------------                          -------------
    submit(prompt, params) ---- Add ----> commands ---> engine.add_request (RequestRejected -> 400)
                                                        while work exists:
                                                            run the commands that came in
                                                            engine.step()
    async for deltas in stream <-- asyncio.Queue <----- loop.call_soon_threadsafe(queue.put_nowait, ...)
    client gone: stream.close() -- Abort --> commands --> engine.abort (its KV blocks are freed)

``call_soon_threadsafe`` is the only safe way into the event loop from another thread: it queues
the ``put_nowait`` call and wakes the loop. With no work the thread sleeps on a condition
variable, so an idle server costs nothing.

Back-pressure: requests accepted but not yet running (the scheduler's waiting queue plus the adds
still in the command list) are counted; past ``max_waiting`` a new request gets a 503 at once,
instead of a queue that grows without bound while every client waits longer.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import defaultdict
from dataclasses import dataclass

from minillm.generation.sampling import SamplingParams
from minillm.runtime.engine import LLMEngine, StepOutput
from minillm.runtime.errors import RequestRejected
from minillm.serve.errors import APIError
from minillm.serve.metrics import ServerMetrics, StatsLogger

log = logging.getLogger("minillm.serve")

ACCEPTED = "accepted"  # the engine took the request: the first item on its queue


class EngineFailure(Exception):
    """The engine failed while the request was in flight (or the server is shutting down)."""


class RequestStream:
    """The HTTP side of one request: ``async for outputs in stream`` yields its tokens of each step."""

    def __init__(self, request_id: str, n: int, num_prompt_tokens: int, owner: AsyncEngine):
        self.request_id, self.n, self.owner = request_id, n, owner
        self.num_prompt_tokens = num_prompt_tokens
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.num_finished = 0
        self.done = False

    def put(self, item) -> None:
        """From the engine thread: hand an item to the event loop."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass

    async def accepted(self) -> None:
        """Wait for the engine's answer to the request: accepted, or the RequestRejected it raised."""
        item = await self.queue.get()
        if isinstance(item, Exception):
            self.done = True
            raise item

    def __aiter__(self):
        return self

    async def __anext__(self) -> list[StepOutput]:
        if self.done:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, Exception):
            self.done = True
            raise item
        self.num_finished += sum(out.finished for out in item)
        self.done = self.num_finished == self.n
        return item

    def close(self) -> None:
        """The caller is done with the request: if it is still running, abort it."""
        if not self.done:
            self.done = True
            self.owner.abort(self.request_id)


@dataclass
class Add:
    stream: RequestStream
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float


@dataclass
class Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_waiting: int = 128,
                 log_interval: float = 10.0):
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
        self.stats_logger = StatsLogger(log_interval)
        self.wakeup = threading.Condition()
        self.commands: list[Add | Abort] = []   # guarded by wakeup
        self.num_waiting = 0                    # guarded by wakeup: scheduler waiting + pending adds
        self.stopping = False                   # guarded by wakeup
        self.streams: dict[str, RequestStream] = {}  # engine thread only
        self.thread = threading.Thread(target=self.run, name="minillm-engine", daemon=True)

    # ---- the event loop's side -----------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Abort whatever is still in flight (its clients get an error event) and end the thread."""
        with self.wakeup:
            self.stopping = True
            self.wakeup.notify()
        self.thread.join()

    @property
    def alive(self) -> bool:
        """Taking requests: started, not stopping, not dead."""
        return self.thread.is_alive() and not self.stopping

    async def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                     arrival: float) -> RequestStream:
        """Queue a request; returns once the engine has accepted it. Raises the engine's RequestRejected,
        or an APIError (503) when the server cannot take it."""
        stream = RequestStream(request_id, params.n, len(prompt_ids), self)
        with self.wakeup:
            if not self.alive:
                raise APIError(503, "the engine is not running (the server is shutting down)")
            if self.num_waiting >= self.max_waiting:
                raise APIError(503, f"the server is overloaded: {self.num_waiting} requests are already waiting "
                                    f"(max_waiting = {self.max_waiting}); retry later")
            self.num_waiting += 1
            self.commands.append(Add(stream, prompt_ids, params, arrival))
            self.wakeup.notify()
        try:
            await stream.accepted()
        except asyncio.CancelledError:  # the client left before the engine got to it
            stream.close()
            raise
        return stream

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
            raise

    def serve_forever(self) -> None:
        while True:
            with self.wakeup:
                if not (self.commands or self.engine.has_unfinished() or self.stopping):
                    self.stats_logger.log(self.engine.stats())  # a burst of work just ended
                    while not (self.commands or self.engine.has_unfinished() or self.stopping):
                        self.wakeup.wait()
                    self.stats_logger.start_window()
                commands, self.commands = self.commands, []
                stopping = self.stopping
            for command in commands:
                self.execute(command)
            if stopping:
                self.fail_all("the server is shutting down")
                return
            if self.engine.has_unfinished():
                self.step()
            with self.wakeup:
                stats = self.engine.stats()
                self.num_waiting = stats.num_waiting + sum(isinstance(c, Add) for c in self.commands)
            self.metrics.observe_engine(stats)

    def execute(self, command: Add | Abort) -> None:
        if isinstance(command, Abort):
            if self.streams.pop(command.request_id, None) is not None:
                self.engine.abort(command.request_id)
            return
        stream = command.stream
        try:
            self.engine.add_request(command.prompt_ids, command.params, request_id=stream.request_id,
                                    arrival=command.arrival)
        except RequestRejected as e:
            stream.put(e)
            return
        self.streams[stream.request_id] = stream
        stream.put(ACCEPTED)

    def step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # the batch is lost; every request in flight gets the error
            log.exception("engine step failed")
            self.fail_all(f"internal error in the engine: {type(e).__name__}: {e}")
            return
        by_request: dict[str, list[StepOutput]] = defaultdict(list)
        for out in outputs:
            by_request[out.request_id].append(out)
        # prompt tokens of the requests whose first token came out in this step
        num_prompt = sum(self.streams[out.request_id].num_prompt_tokens for out in outputs if out.first_token)
        self.metrics.observe_step(len(outputs), num_prompt)
        self.stats_logger.step(self.engine.stats(), len(outputs), num_prompt)
        for request_id, request_outputs in by_request.items():
            self.streams[request_id].put(request_outputs)
            if request_outputs[-1].request_finished:
                self.metrics.observe_finished(self.engine.pop_request(request_id))
                del self.streams[request_id]

    def fail_all(self, message: str) -> None:
        for request_id, stream in list(self.streams.items()):
            self.engine.abort(request_id)
            stream.put(EngineFailure(message))
        self.streams.clear()
