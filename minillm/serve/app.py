"""The OpenAI-compatible HTTP server: the engine thread, the routes and the metrics, put together.

    POST /v1/completions        prompt (text or token ids) -> text, streamed (SSE) or whole
    POST /v1/chat/completions   messages -> the chat template -> the assistant's reply
    GET  /v1/models             the one model served
    GET  /health                200 while the engine thread runs
    GET  /metrics               Prometheus text format (minillm:* series)
    GET  /                      the chat page (``chat_page.py``; its script and style under /static/)

Around them: the Host, Origin and Content-Type checks (``request_guard.py``), API keys (``auth.py``),
one access-log line per request (``access_log.py``); in the
foreground, ``shutdown.py`` drains on SIGTERM/SIGINT.

The routes live in ``routes.py``, the request bodies and their checks in ``protocol.py``, the
engine thread in ``async_engine.py``; ``create_app`` only assembles them around one ``LLM``.

    llm = LLM()
    with BackgroundServer(create_app(llm)) as server:     # tests, notebooks: 127.0.0.1, a free port
        OpenAI(base_url=server.url + "/v1", api_key="x").chat.completions.create(...)
"""
from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from minillm.llm import LLM
from minillm.serve import access_log, auth, body_limit, chat_page, routes, shutdown
from minillm.serve.async_engine import AsyncEngine
from minillm.serve.metrics import ServerMetrics
from minillm.serve.request_guard import RequestGuard

GRACEFUL_SHUTDOWN_S = 30  # on Ctrl-C, in-flight requests get this long to finish before they are aborted


def served_model_name(llm: LLM) -> str:
    """The name clients put in "model": the file name without .gguf, or the model folder's name."""
    return llm.path.name if llm.path.is_dir() else llm.path.stem


def create_app(llm: LLM, model_name: str | None = None, max_waiting: int = 128, log_interval: float = 10.0,
               api_key: str | None = None, protect_metrics: bool = False, request_timeout: float | None = None,
               max_request_tokens: int | None = None, max_body_bytes: int | None = None,
               allowed_origins: list[str] = (), enable_docs: bool = False,
               max_queued_tokens: int | None = None, allowed_hosts: list[str] | None = None) -> FastAPI:
    """The app serving ``llm``; its engine thread starts and stops with the app (FastAPI lifespan).
    ``api_key``: see ``auth.py``; ``request_timeout``, ``max_request_tokens``, ``max_queued_tokens``: ``AsyncEngine``;
    ``max_body_bytes``: ``body_limit.py``; ``allowed_origins``, ``allowed_hosts``: ``request_guard.py``. ``enable_docs``:
    serve FastAPI's /docs and /openapi.json (off by default: they map the server for anyone)."""
    name = model_name or served_model_name(llm)
    limits = llm.engine.stats()  # taken before the engine thread starts: from then on only it touches the engine
    metrics = ServerMetrics(name, limits)
    engine = AsyncEngine(llm.engine, metrics, max_waiting=max_waiting, log_interval=log_interval,
                         request_timeout=request_timeout, max_request_tokens=max_request_tokens,
                         max_queued_tokens=max_queued_tokens)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()  # after uvicorn's graceful wait: whatever is left is aborted

    docs = {} if enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="minillm", lifespan=lifespan, **docs)
    app.router.redirect_slashes = False  # its redirect would echo the client's Host header back as Location
    app.state.engine, app.state.metrics, app.state.llm, app.state.model_name = engine, metrics, llm, name
    app.state.created, app.state.limits = int(time.time()), limits
    app.state.tokenizing = asyncio.Semaphore(1)
    routes.install(app)
    app.include_router(chat_page.router)
    auth.install(app, api_key, protect_metrics)
    body_limit.install(app, max_body_bytes)
    if allowed_origins:  # browsers at those origins may also read the answers (inside the guard: a
        # preflight from a rebound host name or a refused origin never reaches it)
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(RequestGuard, allowed_origins=allowed_origins, allowed_hosts=allowed_hosts)
    access_log.install(app)  # added last, so outermost: it logs the 401s too
    return app


# -----------------------------------------------------------------------------------------------
# Running it


class BackgroundServer:
    """uvicorn serving ``app`` from a daemon thread on 127.0.0.1 and a free port (tests, notebooks)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))  # port 0: the OS picks a free one
        self.host, self.port = self.sock.getsockname()
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="minillm-uvicorn")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Graceful: uvicorn finishes the responses in flight, then the engine thread stops."""
        self.server.should_exit = True
        self.thread.join()
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(host: str = "127.0.0.1", port: int = 8000, model: str | None = None, max_num_seqs: int = 32,
         kv_cache_bytes: int | None = None, max_n: int = 8, allowed_origins: list[str] = (), enable_docs: bool = False, max_waiting: int = 128, activations: str = "fp32",
         model_name: str | None = None, max_model_len: int | None = None, api_key: str | None = None,
         protect_metrics: bool = False, request_timeout: float | None = 600.0, max_request_tokens: int | None = 32768,
         max_body_bytes: int | None = body_limit.DEFAULT_MAX_BODY_BYTES, drain_timeout: float = GRACEFUL_SHUTDOWN_S,
         log_level: str = "info", speculative: dict | None = None, max_queued_tokens: int | None = 16384,
         tensor_parallel_size: int = 1, allowed_hosts: list[str] | None = None) -> int:
    """``minillm serve``: load the model, print how to call it, serve until SIGTERM or Ctrl-C (``shutdown.py``)."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    api_key = auth.resolve_api_key(api_key, protect_metrics)  # a bad combination fails before the model loads
    llm = LLM(model, activations=activations, max_num_seqs=max_num_seqs, kv_cache_bytes=kv_cache_bytes,
              max_n=max_n, speculative=speculative, max_model_len=max_model_len,
              tensor_parallel_size=tensor_parallel_size)
    kv_bytes = llm.engine.commit_kv_cache()  # the server's memory is its size under load, from the start
    app = create_app(llm, model_name=model_name, max_waiting=max_waiting, api_key=api_key,
                     protect_metrics=protect_metrics, request_timeout=request_timeout,
                     max_request_tokens=max_request_tokens, max_body_bytes=max_body_bytes,
                     allowed_origins=allowed_origins, enable_docs=enable_docs, max_queued_tokens=max_queued_tokens,
                     allowed_hosts=allowed_hosts)
    name, url = app.state.model_name, f"http://{host}:{port}"
    key_header = " -H \"Authorization: Bearer $MINILLM_API_KEY\"" if api_key else ""
    print(f"minillm serving {name} at {url}/v1 (chat page at {url}/, metrics at {url}/metrics), "
          f"{kv_bytes / 2**30:.2f} GiB of KV cache committed (--kv-cache-bytes). Ctrl-C stops it.\n"
          f"try:  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{key_header} \\\n"
          f"        -d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi!\"}}]}}'",
          flush=True)
    try:
        return shutdown.serve(app, host, port, drain_timeout, log_level)
    finally:
        llm.close()  # the tensor-parallel ranks, if any
