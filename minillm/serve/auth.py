"""API keys: ``--api-key KEY`` (or ``$MINILLM_API_KEY``) makes ``/v1/*`` require ``Authorization: Bearer KEY``.

The same contract as OpenAI's API and vLLM's ``--api-key``: a missing or wrong key gets a 401 with
OpenAI's error body, which the ``openai`` client raises as ``AuthenticationError``. What stays open:
``/health`` (load balancers probe it without credentials), the chat page at ``/`` (it asks the
user for the key), and ``/metrics`` unless ``--protect-metrics`` (a Prometheus scraper usually
sits inside the operator's network; queue lengths and token counts can still be worth hiding).

It is plain ASGI middleware, so it answers before any route reads the body: an unauthorized client
costs the server no parsing, no tokenizing, no engine time.
"""
from __future__ import annotations

import hmac
import os

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from minillm.serve.errors import error_body

API_KEY_ENV = "MINILLM_API_KEY"


def resolve_api_key(flag: str | None, protect_metrics: bool = False) -> str | None:
    """The flag's key, else the environment's; None (or empty) means the server is open."""
    key = (flag if flag is not None else os.environ.get(API_KEY_ENV)) or None
    check(key, protect_metrics)
    return key


def check(api_key: str | None, protect_metrics: bool) -> None:
    if protect_metrics and api_key is None:
        raise ValueError(f"--protect-metrics needs an API key (--api-key or ${API_KEY_ENV})")


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, protect_metrics: bool = False):
        self.app, self.expected = app, f"Bearer {api_key}".encode()
        self.protect_metrics = protect_metrics

    def guarded(self, path: str) -> bool:
        return path.startswith("/v1/") or (self.protect_metrics and path == "/metrics")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # CORS preflights (OPTIONS) carry no credentials by design: the browser sends the key afterwards
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and self.guarded(scope["path"]):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):  # constant time: no key guessing by timing
                message = ("Missing API key: send it as 'Authorization: Bearer <key>'." if not given
                           else "Incorrect API key provided.")
                response = JSONResponse(error_body(message, code="invalid_api_key"), status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def install(app, api_key: str | None, protect_metrics: bool = False) -> None:
    """Require ``api_key`` on ``app``'s API routes (nothing happens when it is None)."""
    check(api_key, protect_metrics)
    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, protect_metrics=protect_metrics)
