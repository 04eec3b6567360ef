"""What the routes talk to: an ``EngineClient``, and the one stream type every client hands back.

Two clients implement the protocol: ``AsyncEngine`` (one engine stepping in a thread of this
process) and ``ReplicaSet`` (N engines on Ray Serve). The routes know nothing else of them:

    client.check_params(params)                            the checks that need no prompt (RequestRejected)
    stream = await client.submit(prompt_ids, params, request_id, arrival)    -> a RequestStream, accepted
    async for outputs in stream: ...                       each step's list[StepOutput] for the request
    stream.close() / client.abort(request_id)              the client left: the request is aborted
    await client.stats()                                   each engine's latest EngineStats
    client.start(); client.stop()                          stop: every stream in flight ends with an error
    client.alive, client.metrics, client.on_death          /health, /metrics, shutdown.py's hook

A ``RequestStream`` is a queue that a producer fills from any thread (``put``: the engine thread, or
the task that reads a replica's Ray stream): first ``ACCEPTED`` or the exception that refused the
request, then each step's outputs, or an ``EngineFailure`` that ends it. Ending a stream from the
producer's side - a failed step, a timeout, the drain deadline - is therefore the same for every
client: put the failure; the route turns it into an SSE error event and ``[DONE]``.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from minillm.generation.sampling import SamplingParams
from minillm.runtime.engine import EngineStats, StepOutput
from minillm.serve.metrics import ServerMetrics

ACCEPTED = "accepted"  # the engine took the request: the first item on its stream
SHUTTING_DOWN = "the server is shutting down"


class EngineFailure(Exception):
    """The engine failed while the request was in flight (or the server is shutting down)."""
    status = 500


class RequestTimedOut(EngineFailure):
    """The request ran past the server's ``request_timeout``: aborted, its blocks freed."""
    status = 504


class RequestStream:
    """The HTTP side of one request: ``async for outputs in stream`` yields its tokens of each step.
    Made on the event loop; ``put`` may be called from any thread."""

    def __init__(self, request_id: str, n: int, num_prompt_tokens: int, abort: Callable[[str], None]):
        self.request_id, self.n, self.abort = request_id, n, abort
        self.num_prompt_tokens = num_prompt_tokens
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.num_finished = 0
        self.done = False

    def put(self, item) -> None:
        """Hand an item to the event loop (``call_soon_threadsafe``: safe from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass

    async def accepted(self) -> None:
        """Wait for the engine's answer to the request: accepted, or the exception it was refused with."""
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
            self.abort(self.request_id)


class EngineClient(Protocol):
    """An engine as the routes see it (module docstring); ``AsyncEngine`` and ``ReplicaSet`` implement it."""
    metrics: ServerMetrics                       # what /metrics exports
    on_death: Callable[[], None] | None          # called if the client can serve no more (shutdown.py)

    @property
    def alive(self) -> bool:
        """Taking requests: started, not stopping, not dead."""

    def start(self) -> None: ...

    def stop(self) -> None:
        """New requests get a 503; every request in flight ends with an ``EngineFailure`` and is aborted."""

    def check_params(self, params: SamplingParams) -> None:
        """The engine's checks that need no prompt (``EngineLimits.check_params``): ``RequestRejected``."""

    async def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                     arrival: float) -> RequestStream:
        """Start a request; returns once an engine accepted it. Raises ``RequestRejected`` (400) or
        ``APIError`` (503: overloaded, or shutting down)."""

    def abort(self, request_id: str) -> None:
        """Stop a request (its client left): its KV blocks are freed."""

    async def stats(self) -> list[EngineStats]:
        """Each engine's latest ``EngineStats``, in order (one for a single engine)."""
