"""What a request must look like before any route reads it: for this host, JSON, from an allowed origin.

A server on 127.0.0.1 is not private: every web page the developer opens can make their browser
send it requests. A page may POST a "simple" request (``Content-Type: text/plain``, a form) to
any address without a CORS preflight; the browser hides the answer from the page, but the server
has done the work by then. And by DNS rebinding, a page at ``http://evil.example:8000`` whose name
the attacker re-points at 127.0.0.1 becomes same-origin with the server: the browser lets it read
every answer, ``/metrics`` and ``/v1/models`` included, and sends ``Host: evil.example``. So, on
every request, every route:

    a Host header that is not allowed              403   (a server bound to loopback answers only
                                                          to localhost, 127.0.0.1, [::1] and the
                                                          names of --allowed-hosts, as Jupyter does)
    no Host header at all                          400   (HTTP/1.1 requires one)
    POST without Content-Type application/json    415   (a cross-site page cannot send that
                                                          type without a preflight, which fails)
    an Origin header that is not allowed          403   (browsers always send Origin on a
                                                          cross-site POST)

(The body's size has its own limit, ``body_limit.py``.)

Allowed origins: the server's own (``http://<address it was reached on>:<port>``,
``http://localhost:<port>``, ``http://127.0.0.1:<port>`` - the chat page at ``/``), and those
given with ``--allowed-origins`` (vLLM's flag; ``"*"`` allows any). Clients that are not browsers
(curl, the ``openai`` package) send no Origin and are not concerned. The address comes from the
socket, never from the ``Host`` header, which the client writes (a DNS-rebinding page controls it).
"""
from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from minillm.serve.errors import error_body


class RequestGuard:
    """ASGI middleware: the checks of the module docstring, before the app sees the request."""

    def __init__(self, app: ASGIApp, allowed_origins: Iterable[str] = (), allowed_hosts: Iterable[str] | None = None):
        self.app = app
        self.allowed = {o.rstrip("/") for o in allowed_origins}
        self.allowed_hosts = None if allowed_hosts is None else {h.lower() for h in allowed_hosts}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.checks_host(scope):
            host = headers.get("host")
            if host is None:
                return await reply(send, 400, "the request has no Host header", "host")
            if not self.host_allowed(host):
                return await reply(send, 403, f"the Host header {host[:200]!r} is not allowed: this server answers "
                                              "only localhost, 127.0.0.1 and [::1] (a protection against DNS "
                                              "rebinding); start it with --allowed-hosts to allow that name", "host")
        origin = headers.get("origin")
        if origin is not None and not self.origin_allowed(origin, scope):
            return await reply(send, 403, f"requests from the web origin {origin[:200]!r} are not allowed; "
                                          "start the server with --allowed-origins to allow it", "origin")
        if scope["method"] == "POST":
            media_type = headers.get("content-type", "").split(";")[0].strip().lower()
            if media_type != "application/json":
                return await reply(send, 415, f"Content-Type must be application/json, got "
                                              f"{media_type[:100] or 'none'!r}", "content-type")
        await self.app(scope, receive, send)

    def checks_host(self, scope: Scope) -> bool:
        if self.allowed_hosts is not None:
            return "*" not in self.allowed_hosts
        return is_loopback((scope.get("server") or ("", 0))[0])

    def host_allowed(self, host: str) -> bool:
        """``host`` is the header's value: a name or address, maybe ``[v6]``, maybe ``:port``."""
        name = host[1:].split("]")[0] if host.startswith("[") else host.rsplit(":", 1)[0]
        return name.lower() == "localhost" or is_loopback(name) or name.lower() in (self.allowed_hosts or ())

    def origin_allowed(self, origin: str, scope: Scope) -> bool:
        if "*" in self.allowed or origin.rstrip("/") in self.allowed:
            return True
        host, port = scope.get("server") or ("", 0)
        own = {host, "localhost", "127.0.0.1", "[::1]"}
        return origin in {f"http://{h}:{port}" for h in own}


def is_loopback(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:  # a name, not an address
        return False
    # an IPv4 address seen through a dual-stack socket (::ffff:127.0.0.1): Python 3.11 calls it not loopback
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


async def reply(send: Send, status: int, message: str, param: str | None = None) -> None:
    body = json.dumps(error_body(message, param=param)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
