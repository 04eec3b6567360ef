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

The routes live in ``routes.py``, the request bodies and their checks in ``protocol.py``; the
engine behind them is an ``EngineClient`` (``client.py``): the engine thread of ``async_engine.py``,
or the Ray replicas of ``replicas.py``. ``create_app`` only assembles the routes around one client,
a tokenizer and the engine's limits; the server's knobs are one ``ServerConfig`` (``config.py``).

    llm = LLM()
    with BackgroundServer(llm_app(llm)) as server:     # tests, notebooks: 127.0.0.1, a free port
        OpenAI(base_url=server.url + "/v1", api_key="x").chat.completions.create(...)
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from minillm.generation.tokenizer import Tokenizer
from minillm.llm import LLM
from minillm.runtime.config import EngineConfig, EngineLimits
from minillm.runtime.engine import LLMEngine
from minillm.serve import access_log, auth, body_limit, chat_page, routes, shutdown
from minillm.serve.async_engine import AsyncEngine
from minillm.serve.client import EngineClient
from minillm.serve.config import GRACEFUL_SHUTDOWN_S, ServerConfig
from minillm.serve.metrics import ServerMetrics
from minillm.serve.request_guard import RequestGuard


def served_model_name(path: Path) -> str:
    """The name clients put in "model": the file name without .gguf, or the model folder's name."""
    return path.name if path.is_dir() else path.stem


def create_app(client: EngineClient, tokenizer: Tokenizer, limits: EngineLimits, model_name: str,
               config: ServerConfig = ServerConfig()) -> FastAPI:
    """The OpenAI routes in front of ``client``, which starts and stops with the app (FastAPI
    lifespan). ``tokenizer``: the model's (its chat template too); ``limits``: the engine's, for the
    prompt-length cut and /v1/models; ``model_name``: what clients send as "model" (and the metrics'
    label, which the client's ``metrics`` carry). ``config``: the HTTP side - ``api_key`` (``auth.py``,
    resolved already), ``max_body_bytes`` (``body_limit.py``), ``allowed_origins``, ``allowed_hosts``
    (``request_guard.py``), ``enable_docs`` (FastAPI's /docs and /openapi.json: off by default, they
    map the server for anyone)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client.start()
        yield
        client.stop()  # after uvicorn's graceful wait: whatever is left is aborted

    docs = {} if config.enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="minillm", lifespan=lifespan, **docs)
    app.router.redirect_slashes = False  # its redirect would echo the client's Host header back as Location
    state = app.state
    state.client, state.metrics, state.tokenizer, state.limits = client, client.metrics, tokenizer, limits
    state.model_name, state.created = model_name, int(time.time())
    state.tokenizing = asyncio.Semaphore(1)
    routes.install(app)
    app.include_router(chat_page.router)
    auth.install(app, config.api_key, config.protect_metrics)
    body_limit.install(app, config.max_body_bytes)
    origins = list(config.allowed_origins)
    if origins:  # browsers at those origins may also read the answers (inside the guard: a preflight
        # from a rebound host name or a refused origin never reaches it)
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    hosts = None if config.allowed_hosts is None else list(config.allowed_hosts)
    app.add_middleware(RequestGuard, allowed_origins=origins, allowed_hosts=hosts)
    access_log.install(app)  # added last, so outermost: it logs the 401s too
    return app


def local_client(engine: LLMEngine, model_name: str, config: ServerConfig = ServerConfig()) -> AsyncEngine:
    """``engine`` in an engine thread, with its metrics, admitting requests by ``config``."""
    metrics = ServerMetrics(model_name, engine.stats())  # before the thread starts: from then on only it touches the engine
    return AsyncEngine(engine, metrics, **config.admission())


def llm_app(llm: LLM, config: ServerConfig = ServerConfig()) -> FastAPI:
    """The app serving ``llm``'s engine from an engine thread of this process."""
    name = config.served_model_name or served_model_name(llm.path)
    return create_app(local_client(llm.engine, name, config), llm.tokenizer, llm.engine.limits, name, config)


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


def main(engine: EngineConfig = EngineConfig(), server: ServerConfig = ServerConfig(),
         load: Callable[[EngineConfig], LLM] = LLM) -> int:
    """``minillm serve``: load the model, print how to call it, serve until SIGTERM or Ctrl-C (``shutdown.py``).
    ``load`` builds the LLM from ``engine`` (``serve --exercises``: on the learner's pieces, minillm.course)."""
    logging.basicConfig(level=server.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # a bad combination fails before the model loads
    server = dataclasses.replace(server, api_key=auth.resolve_api_key(server.api_key, server.protect_metrics))
    llm = load(engine)
    kv_bytes = llm.engine.commit_kv_cache()  # the server's memory is its size under load, from the start
    app = llm_app(llm, server)
    name, url = app.state.model_name, f"http://{server.host}:{server.port}"
    key_header = " -H \"Authorization: Bearer $MINILLM_API_KEY\"" if server.api_key else ""
    print(f"minillm serving {name} at {url}/v1 (chat page at {url}/, metrics at {url}/metrics), "
          f"{kv_bytes / 2**30:.2f} GiB of KV cache committed (--kv-cache-bytes). Ctrl-C stops it.\n"
          f"try:  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{key_header} \\\n"
          f"        -d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi!\"}}]}}'",
          flush=True)
    try:
        return shutdown.serve(app, server.host, server.port, server.drain_timeout, server.log_level)
    finally:
        llm.close()  # the tensor-parallel ranks, if any
