"""One log line per request, written when its response has gone out:

    INFO minillm.access 127.0.0.1 "POST /v1/chat/completions" 200 id=chatcmpl-9f.. prompt_tokens=31
         output_tokens=64 ttft=0.412s total=3.071s

The middleware sees every request (rejected ones too: a 401, a 400, a 503 each get a line) and
times it from its first byte in to its last byte out. Token counts and the time to first token
are known only to the route that generated: ``track`` hands it the response builder, whose token
counts the middleware reads as the response body goes out. The first body message sent after a
token has arrived is the first token reaching the client - the TTFT a streaming client sees. A
whole (non-streamed) response shows no first token of its own: its line says ``ttft=-``.

It replaces uvicorn's own access log, which knows nothing of tokens.
"""
from __future__ import annotations

import logging
import time

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minillm.serve.responses import ResponseBuilder

log = logging.getLogger("minillm.access")

SCOPE_KEY = "minillm.access"  # where the route finds this request's record
QUIET_PATHS = ("/health", "/metrics")


class AccessRecord:
    def __init__(self):
        self.start = time.perf_counter()
        self.status: int | None = None
        self.builder: ResponseBuilder | None = None
        self.ttft: float | None = None
        self.streamed = False

    def on_send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body" and self.builder is not None and self.ttft is None:
            more = message.get("more_body", False)
            self.streamed |= more
            if self.streamed and any(c.num_tokens for c in self.builder.choices):
                self.ttft = time.perf_counter() - self.start

    def line(self, scope: Scope) -> str:
        client = scope.get("client")
        parts = [client[0] if client else "-", f'"{scope["method"]} {scope["path"]}"', str(self.status or "-")]
        if self.builder is not None:
            usage = self.builder.usage
            parts += [f"id={self.builder.id}", f"prompt_tokens={usage['prompt_tokens']}",
                      f"output_tokens={usage['completion_tokens']}",
                      "ttft=-" if self.ttft is None else f"ttft={self.ttft:.3f}s"]
        parts.append(f"total={time.perf_counter() - self.start:.3f}s")
        return " ".join(parts)


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = scope[SCOPE_KEY] = AccessRecord()

        async def logged_send(message: Message) -> None:
            record.on_send(message)
            await send(message)

        try:
            await self.app(scope, receive, logged_send)
        except Exception:
            record.status = record.status or 500  # the outermost handler answers it with a 500 body
            raise
        finally:  # a client that left, an error: the line is written all the same
            # probes and scrapes come every few seconds: their lines only at --log-level debug
            log.log(logging.DEBUG if scope["path"] in QUIET_PATHS else logging.INFO, record.line(scope))


def track(request: Request, builder: ResponseBuilder) -> None:
    """Called by a generating route: this request's line reports ``builder``'s id and token counts."""
    record = request.scope.get(SCOPE_KEY)
    if record is not None:
        record.builder = builder


def install(app) -> None:
    app.add_middleware(AccessLogMiddleware)
