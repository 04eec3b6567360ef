"""The HTTP routes: plain handlers reading the app's state (``request.app.state``), and the error handlers.

A request's life: parse and validate the body (``protocol``, 400 on any problem) -> the engine's
checks that need no prompt (``n``, stop strings: before any work that grows with the request) ->
tokenize (chat: render the model's chat template first), stopping as soon as the prompt cannot fit
in the context -> hand it to the engine thread, whose engine checks it against its limits
(``RequestRejected`` -> 400 naming the field) or answers 503 when the waiting queue is full -> stream each step's new text back as SSE chunks, or gather it into one response. A
client that disconnects aborts its request, which frees its KV blocks at once.

``app.state`` holds: ``client`` (the ``EngineClient``), ``metrics`` (the client's), ``tokenizer``
(the model's, with its chat template), ``limits`` (the engine's ``EngineLimits``), ``model_name``,
``created`` (Unix time) and ``tokenizing`` (a semaphore: one prompt is tokenized at a time, see
``tokenized``).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from minillm.generation.sampling import SamplingParams
from minillm.generation.tokenizer import TooManyTokens
from minillm.llm import chat_prompt
from minillm.runtime.errors import CONTEXT_LENGTH_EXCEEDED, RequestRejected
from minillm.serve import access_log
from minillm.serve.client import EngineFailure, RequestStream
from minillm.serve.errors import APIError, bad_request, error_body
from minillm.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, parse_request
from minillm.serve.responses import ChatResponseBuilder, CompletionResponseBuilder, ResponseBuilder
from minillm.serve.sse import SSE_DONE, sse_event  # every event is written through this module's
# sse_event (``minillm serve --exercises`` puts chapter 09's there)

log = logging.getLogger("minillm.serve")

router = APIRouter()


# ---- the OpenAI endpoints ------------------------------------------------------------------

@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    arrival, state = time.perf_counter(), request.app.state
    body = await checked_body(request, CompletionRequest)
    params = checked_params(request, body)
    prompt = body.single_prompt()
    if isinstance(prompt, str):  # special tokens written in a raw prompt are parsed, as vLLM does
        prompt_ids = await tokenized(request, body, state.tokenizer.encode, prompt)
    else:
        prompt_ids = prompt
    return await generate(request, body, CompletionResponseBuilder, prompt_ids, params, arrival)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    arrival, state = time.perf_counter(), request.app.state
    body = await checked_body(request, ChatCompletionRequest)
    messages = body.conversation()
    params = checked_params(request, body)
    prompt_ids = await tokenized(request, body, functools.partial(chat_prompt, state.tokenizer), messages)  # template, BPE
    return await generate(request, body, ChatResponseBuilder, prompt_ids, params, arrival)


@router.get("/v1/models")
async def models(request: Request) -> dict:
    state = request.app.state
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                        "owned_by": "minillm", "max_model_len": state.limits.max_model_len}]}


@router.get("/health")
async def health(request: Request) -> Response:
    if not request.app.state.client.alive:
        raise APIError(503, "the engine is not running")
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


# ---- errors: always OpenAI's body --------------------------------------------------------------

async def api_error(request: Request, e: APIError) -> Response:
    return JSONResponse(e.body(), status_code=e.status)


async def http_error(request: Request, e: HTTPException) -> Response:  # unknown route (404), wrong method (405)
    message = f"Invalid URL ({request.method} {request.url.path})" if e.status_code == 404 else str(e.detail)
    return JSONResponse(error_body(message), status_code=e.status_code)


class ClientGone(Exception):
    """The client disconnected before its request was read whole."""


async def client_gone(request: Request, e: ClientGone) -> Response:
    log.info("%s %s: the client disconnected while sending its request", request.method, request.url.path)
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


async def internal_error(request: Request, e: Exception) -> Response:
    log.exception("internal error")
    return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), status_code=500)


def install(app: FastAPI) -> None:
    """The routes and the error handlers, on ``app``."""
    app.include_router(router)
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(ClientGone, client_gone)
    app.add_exception_handler(Exception, internal_error)


# ---- sending the tokens back -------------------------------------------------------------------

async def checked_body(request: Request, kind: type[SamplingFields]) -> SamplingFields:
    """The parsed body, for the model this server serves, with consistent stream options."""
    try:
        raw = await request.body()
    except ClientDisconnect:  # it left while sending: nothing to answer, nothing went wrong here
        raise ClientGone() from None
    body = parse_request(raw, kind)
    body.check_model(request.app.state.model_name)
    body.check_stream_options()
    return body


def checked_params(request: Request, body: SamplingFields) -> SamplingParams:
    """The sampling parameters, through the engine's checks that need no prompt."""
    params = body.to_sampling_params()
    try:
        request.app.state.client.check_params(params)
    except RequestRejected as e:
        raise body.rejection(e) from None
    return params


async def tokenized(request: Request, body: SamplingFields, encode, prompt) -> list[int]:
    """``encode(prompt, max_tokens=...)`` off the event loop, stopped as soon as the prompt is too long
    for the context (``TooManyTokens``, raised before any BPE when the text alone is too long)."""
    limit = request.app.state.limits.max_model_len
    try:
        # One prompt at a time: BPE is Python holding the GIL, and many threads of it at once would
        # starve the event loop (/health took seconds under 50 long prompts at once).
        async with request.app.state.tokenizing:
            return await run_in_threadpool(encode, prompt, max_tokens=limit - 1)  # >= 1 token stays for the reply
    except TooManyTokens as e:
        raise body.rejection(RequestRejected(f"This model's maximum context length is {limit} tokens, and the prompt "
                                             f"does not fit: {e}. Please shorten the prompt.", "prompt",
                                             CONTEXT_LENGTH_EXCEEDED)) from None
    except ValueError as e:  # the chat template refused the conversation
        raise bad_request(str(e), "messages") from None


async def generate(request: Request, body: SamplingFields, builder_kind: type[ResponseBuilder],
                   prompt_ids: list[int], params: SamplingParams, arrival: float) -> Response:
    """Submit to the engine thread; stream the response or gather it whole."""
    state = request.app.state
    builder = builder_kind(state.model_name, state.tokenizer, params.n, len(prompt_ids),
                           params.logprobs is not None, body.include_usage)
    if isinstance(body, ChatCompletionRequest) and body.parses_tool_calls:
        builder.parse_tool_calls = True
    access_log.track(request, builder)
    try:
        stream = await state.client.submit(prompt_ids, params, builder.id, arrival)
    except RequestRejected as e:
        raise body.rejection(e) from None
    if body.stream:
        return StreamingResponse(sse_stream(stream, builder), media_type="text/event-stream")
    return JSONResponse(await gather(request, stream, builder))


async def sse_stream(stream: RequestStream, builder: ResponseBuilder):
    """The SSE body: chunks as tokens arrive; an engine failure becomes an error event; then [DONE].

    If the client disconnects, Starlette cancels this generator at its ``await``: ``finally``
    aborts the request, and its blocks go back to the pool.
    """
    try:
        for chunk in builder.start_chunks():
            yield sse_event(chunk)
        async for outputs in stream:
            for out in outputs:
                if (chunk := builder.add(out)) is not None:
                    yield sse_event(chunk)
        if builder.include_usage:
            yield sse_event(builder.usage_chunk())
    except EngineFailure as e:  # headers are sent already: the error travels as an event
        yield sse_event(APIError(e.status, str(e)).body())
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
        async for outputs in stream:
            for out in outputs:
                builder.add(out)

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
        raise APIError(e.status, str(e)) from None
    return builder.response()
