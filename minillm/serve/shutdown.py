"""Running ``minillm serve`` in the foreground with the signal contract operators expect:

    first SIGTERM or SIGINT   stop accepting connections; requests in flight get up to
                              ``drain_timeout`` seconds to finish, then they are aborted (their
                              clients get an error event, their KV blocks are freed); exit 0
    a second signal           exit at once (status 1): the operator has stopped waiting
    the engine thread dies    stop serving, exit 1 (a supervisor restarts the process)

uvicorn already drains on the first signal, but afterwards it re-raises the signal it caught, so a
process stopped by SIGTERM (``docker stop``, systemd, Kubernetes) ends with status 143 instead of
0, and a second SIGTERM is ignored. ``DrainingServer`` keeps uvicorn's drain and replaces the
signal handling. It also owns the deadline: at its own timeout uvicorn cancels the handlers' tasks,
which cuts each stream mid-chunk (no error event, no ``[DONE]``) and logs a ``CancelledError``
traceback per request. Instead, at ``drain_timeout`` the engine client is stopped (``EngineClient.stop``:
the engine thread, or every replica call), which ends every
request still in flight with its error (an SSE error event then ``data: [DONE]``, or a JSON
error); uvicorn's own cancellation waits ``FLUSH_S`` more, for clients that stopped reading.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable

import uvicorn

log = logging.getLogger("minillm.serve")

SIGNALS = (signal.SIGINT, signal.SIGTERM)
FORCED_EXIT_STATUS = 1
FLUSH_S = 5.0  # after the deadline: for the error events to reach their clients before uvicorn cancels


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain_timeout: float, end_requests: Callable[[], None]):
        super().__init__(config)
        self.drain_timeout, self.end_requests = drain_timeout, end_requests

    async def shutdown(self, sockets=None) -> None:
        deadline = asyncio.get_running_loop().call_later(self.drain_timeout, self.end_drain)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    def end_drain(self) -> None:
        log.warning("drain timeout (%s s): ending the requests still in flight with an error", self.drain_timeout)
        # in a thread: stopping the engine waits for its step to end, which must not hold the event loop
        threading.Thread(target=self.end_requests, name="minillm-drain-deadline", daemon=True).start()
    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
            yield
            return
        previous = {sig: signal.signal(sig, self.on_signal) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def on_signal(self, sig: int, frame) -> None:
        name = signal.Signals(sig).name
        if self.should_exit:
            log.warning("%s again: exiting now, without waiting for the requests in flight", name)
            os._exit(FORCED_EXIT_STATUS)
        log.info("%s: no new connections; draining requests in flight for up to %s s (send it again to exit now)",
                 name, self.drain_timeout)
        self.should_exit = True


def serve(app, host: str, port: int, drain_timeout: float, log_level: str = "info") -> int:
    """Serve ``app`` until a signal; returns the exit status (0 after a drain)."""
    if drain_timeout < 0:
        raise ValueError(f"drain_timeout must be >= 0 seconds, got {drain_timeout}")
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,  # ours: access_log.py
                            timeout_graceful_shutdown=drain_timeout + FLUSH_S)
    server, engine_died = DrainingServer(config, drain_timeout, app.state.client.stop), []

    def stop_serving() -> None:  # from the engine thread: a dead engine must not sit behind a live port
        engine_died.append(True)
        server.should_exit = True

    app.state.client.on_death = stop_serving
    server.run()
    return 1 if engine_died else 0
