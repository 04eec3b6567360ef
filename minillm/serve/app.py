"""The OpenAI-compatible HTTP server: FastAPI routes around the engine thread.

    POST /v1/completions        prompt (text or token ids) -> text, streamed (SSE) or whole
    POST /v1/chat/completions   messages -> the chat template -> the assistant's reply
    GET  /v1/models             the one model served
    GET  /health                200 while the engine thread runs
    GET  /metrics               Prometheus text format (minillm:* series)

A request's life: parse and validate the body (400 on any problem) -> tokenize (chat: render the
model's chat template first) -> check that prompt + max_tokens fit the context -> hand it to the
engine thread (503 if the waiting queue is full) -> stream each step's new text back as SSE
chunks, or gather it into one response. A client that disconnects aborts its request, which frees
its KV blocks at once.

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
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from minillm.generation.sampling import SamplingParams
from minillm.llm import LLM
from minillm.serve.async_engine import AsyncEngine, EngineFailure, RequestStream
from minillm.serve.errors import APIError, bad_request, error_body
from minillm.serve.metrics import ServerMetrics
from minillm.serve.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from minillm.serve.responses import ChatResponseBuilder, CompletionResponseBuilder, ResponseBuilder
from minillm.serve.sse import SSE_DONE, sse_event

log = logging.getLogger("minillm.serve")

GRACEFUL_SHUTDOWN_S = 30  # on Ctrl-C, in-flight requests get this long to finish before they are aborted


def served_model_name(llm: LLM) -> str:
    """The name clients put in "model": the file name without .gguf, or the model folder's name."""
    return llm.path.name if llm.path.is_dir() else llm.path.stem


def create_app(llm: LLM, model_name: str | None = None, max_waiting: int = 128, log_interval: float = 10.0) -> FastAPI:
    """The app serving ``llm``; its engine thread starts and stops with the app (FastAPI lifespan)."""
    name = model_name or served_model_name(llm)
    tokenizer = llm.tokenizer
    metrics = ServerMetrics(name)
    engine = AsyncEngine(llm.engine, metrics, max_waiting=max_waiting, log_interval=log_interval)
    block_manager = llm.engine.block_manager
    # The longest sequence one request may ask for: the context, or the whole KV cache if smaller.
    max_model_len = min(llm.model.config.context_length, block_manager.num_blocks * block_manager.block_size)
    max_num_seqs = llm.engine.scheduler.max_num_seqs
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()  # after uvicorn's graceful wait: whatever is left is aborted

    app = FastAPI(title="minillm", lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.llm, app.state.model_name = engine, metrics, llm, name

    # ---- errors: always OpenAI's body ------------------------------------------------------

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # unknown route (404), wrong method (405)
        message = f"Invalid URL ({request.method} {request.url.path})" if e.status_code == 404 else str(e.detail)
        return JSONResponse(error_body(message), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("internal error")
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), status_code=500)

    # ---- helpers ---------------------------------------------------------------------------

    def check_model(model: str) -> None:
        if model != name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves `{name}`.", "model",
                           "model_not_found")

    def check_token_ids(ids: list[int], param: str) -> None:
        bad = [i for i in ids if not 0 <= i < tokenizer.vocab_size]
        if bad:
            raise bad_request(f"{param} holds token ids outside the vocabulary [0, {tokenizer.vocab_size}): "
                              f"{bad[:5]}", param)

    def fit_max_tokens(prompt_len: int, requested: int | None, param: str, prompt_param: str) -> int:
        """The completion budget: the request's, checked against the context, or all that is left."""
        if prompt_len >= max_model_len:
            raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your "
                              f"{prompt_param} has {prompt_len} tokens, leaving no room for a completion. Please "
                              f"shorten the {prompt_param}.", prompt_param, "context_length_exceeded")
        if requested is None:
            return max_model_len - prompt_len
        if requested >= 1 and prompt_len + requested > max_model_len:
            raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you "
                              f"requested {prompt_len + requested} tokens ({prompt_len} in the {prompt_param}, "
                              f"{requested} in the completion). Please reduce the length of the {prompt_param} "
                              f"or completion.", param, "context_length_exceeded")
        return requested  # values < 1 are left for SamplingParams to refuse

    async def generate(request: Request, builder: ResponseBuilder, prompt_ids: list[int], params: SamplingParams,
                       stream: bool, arrival: float) -> Response:
        check_token_ids(params.stop_token_ids, "stop_token_ids")
        if params.n > max_num_seqs:  # its n sequences must run side by side
            raise bad_request(f"n = {params.n} exceeds this server's max_num_seqs ({max_num_seqs})", "n")
        request_stream = await engine.submit(prompt_ids, params, builder.id, arrival)
        if stream:
            return StreamingResponse(sse_stream(request_stream, builder), media_type="text/event-stream")
        return JSONResponse(await gather(request, request_stream, builder))

    # ---- routes ------------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()
        body = parse_request(await request.body(), CompletionRequest)
        check_model(body.model)
        body.check_stream_options()
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            prompt_ids = await run_in_threadpool(tokenizer.encode, prompt)  # long prompts: keep the loop free
        else:
            check_token_ids(prompt, "prompt")
            prompt_ids = prompt
        params = body.to_sampling_params(fit_max_tokens(len(prompt_ids), body.max_tokens, "max_tokens", "prompt"))
        builder = CompletionResponseBuilder(name, tokenizer, params.n, len(prompt_ids), params.logprobs is not None,
                                            body.include_usage)
        return await generate(request, builder, prompt_ids, params, bool(body.stream), arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.perf_counter()
        body = parse_request(await request.body(), ChatCompletionRequest)
        check_model(body.model)
        body.check_stream_options()
        if not body.messages:
            raise bad_request("messages must be a non-empty list", "messages")
        try:  # the model's chat template, then the tokenizer
            prompt_ids = await run_in_threadpool(llm.chat_prompt, [m.as_dict() for m in body.messages])
        except ValueError as e:  # the template refused the conversation
            raise bad_request(str(e), "messages") from None
        requested, param = body.requested_max_tokens()
        params = body.to_sampling_params(fit_max_tokens(len(prompt_ids), requested, param, "messages"))
        builder = ChatResponseBuilder(name, tokenizer, params.n, len(prompt_ids), params.logprobs is not None,
                                      body.include_usage)
        return await generate(request, builder, prompt_ids, params, bool(body.stream), arrival)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "minillm", "max_model_len": max_model_len}]}

    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            raise APIError(503, "the engine is not running")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


# -----------------------------------------------------------------------------------------------
# Sending the tokens back


async def sse_stream(stream: RequestStream, builder: ResponseBuilder):
    """The SSE body: chunks as tokens arrive; an engine failure becomes an error event; then [DONE].

    If the client disconnects, Starlette cancels this generator at its ``await``: ``finally``
    aborts the request, and its blocks go back to the pool.
    """
    try:
        for chunk in builder.start_chunks():
            yield sse_event(chunk)
        async for deltas in stream:
            for delta in deltas:
                if (chunk := builder.add(delta)) is not None:
                    yield sse_event(chunk)
        if builder.include_usage:
            yield sse_event(builder.usage_chunk())
    except EngineFailure as e:  # headers are sent already: the error travels as an event
        yield sse_event(APIError(500, str(e)).body())
    except Exception as e:
        log.exception("internal error in a stream")
        yield sse_event(APIError(500, f"internal error: {type(e).__name__}: {e}").body())
    finally:
        stream.close()
    yield SSE_DONE


async def gather(request: Request, stream: RequestStream, builder: ResponseBuilder) -> dict:
    """The whole response, while watching for the client leaving (non-streamed requests, too, are
    aborted when nobody waits for them)."""
    async def consume():
        async for deltas in stream:
            for delta in deltas:
                builder.add(delta)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    consumer, watcher = asyncio.ensure_future(consume()), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        consumer.cancel()
        stream.close()
    if consumer not in done:
        return {}  # the client is gone; nobody reads this
    try:
        consumer.result()
    except EngineFailure as e:
        raise APIError(500, str(e)) from None
    return builder.response()


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
         kv_cache_bytes: int = 256 << 20, max_waiting: int = 128) -> int:
    """``minillm serve``: load the model, print how to call it, serve until Ctrl-C."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    llm = LLM(model, max_num_seqs=max_num_seqs, kv_cache_bytes=kv_cache_bytes)
    app = create_app(llm, max_waiting=max_waiting)
    name, url = app.state.model_name, f"http://{host}:{port}"
    print(f"minillm serving {name} at {url}/v1 (metrics at {url}/metrics). Ctrl-C stops it.\n"
          f"try:  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
          f"        -d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi!\"}}]}}'",
          flush=True)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    return 0
