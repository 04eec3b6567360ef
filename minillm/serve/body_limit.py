"""``--max-body-bytes``: a request body larger than this gets a 413 with OpenAI's error body.

Checked before any route reads the body: a declared ``Content-Length`` over the limit is refused
at once, and a body sent without one (chunked) is counted as it arrives and cut off at the limit,
so a client can never make the server hold more than ``max_bytes`` of one request in memory.
"""
from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minillm.serve.errors import error_body

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a full context as text or token ids is a few tens of KB


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def too_large(self) -> JSONResponse:
        return JSONResponse(error_body(f"the request body exceeds this server's limit of {self.max_bytes} bytes",
                                       code="request_too_large"), status_code=413)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self.too_large()(scope, receive, send)
            return
        received, started = 0, False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started |= message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except BodyTooLarge:
            if not started:
                await self.too_large()(scope, receive, send)


def install(app, max_bytes: int | None) -> None:
    if max_bytes is not None:
        if max_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_bytes}")
        app.add_middleware(BodyLimitMiddleware, max_bytes=max_bytes)
