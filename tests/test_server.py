"""The server against the official ``openai`` client, on the real model, over real HTTP.

One server (127.0.0.1, a free port) serves the whole module from a background thread. Outputs are
checked against facts: streamed text equals the whole text, token counts equal the tokenizer's,
greedy equals top_k=1, concurrent requests equal the same requests sent one by one, and no KV
block is left held after a request ends - however it ends.
"""
import asyncio
import json
import threading
import time
from collections.abc import Callable

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minillm.llm import LLM, chat_prompt
from minillm.serve.app import BackgroundServer, llm_app
from minillm.serve.config import ServerConfig
from minillm.serve.loadgen import LoadConfig, benchmark, main as loadgen_main

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["Once upon a time", "def fibonacci(n):", "The three primary colors are", "1, 2, 3, 4,",
           "Water boils at", "Roses are red,", "SELECT * FROM", "The quick brown fox"]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path, max_num_seqs=32)


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.tokenizer


@pytest.fixture(scope="module")
def server(llm):
    with BackgroundServer(llm_app(llm, ServerConfig(log_interval=5.0))) as server:
        yield server


def wait_until(condition, what: str | Callable[[], str], timeout: float = 300.0) -> None:
    """Poll the server's state (it changes in the engine thread); the timeout only guards a hang.
    ``what`` may be a function: its text, asked at the timeout, can say what was seen last."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what() if callable(what) else what}"
        time.sleep(0.05)


def assert_all_blocks_free(server) -> None:
    engine, streams = server.app.state.client.engine, server.app.state.client.streams

    def all_free():
        stats = engine.stats()
        return not engine.has_unfinished() and not streams and stats.num_free_blocks == stats.num_blocks
    wait_until(all_free, "every request is gone and every KV block is free")


def read_metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    return {(s.name, s.labels.get("finished_reason")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# -----------------------------------------------------------------------------------------------
# The OpenAI surface


def test_models_and_health(client, server, model):
    models = client.models.list()
    assert [m.id for m in models.data] == [model] and models.data[0].object == "model"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


@pytest.fixture(scope="module")
def chat_whole_and_streamed(client, model):
    whole = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=12)
    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=12,
                                                 stream=True, stream_options={"include_usage": True}))
    return whole, chunks


def test_chat_answers_like_transformers(chat_whole_and_streamed):
    whole, _ = chat_whole_and_streamed
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == "The capital of France is Paris."  # REFERENCE.md's greedy answer
    assert whole.choices[0].finish_reason == "stop"


def test_chat_stream_is_the_same_text_in_openai_chunks(chat_whole_and_streamed):
    whole, chunks = chat_whole_and_streamed
    *content, usage_chunk = chunks
    assert all(c.object == "chat.completion.chunk" and c.id == content[0].id for c in chunks)
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content) == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in content if c.choices[0].finish_reason is not None]
    assert finishes == ["stop"] and content[-1].choices[0].finish_reason == "stop"
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}) == \
        whole.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})


def test_usage_counts_are_the_tokenizers(chat_whole_and_streamed, tokenizer):
    whole, _ = chat_whole_and_streamed
    assert whole.usage.prompt_tokens == len(chat_prompt(tokenizer, QUESTION))
    expected = tokenizer.encode(whole.choices[0].message.content) + [tokenizer.eos_id]  # eos is counted
    assert whole.usage.completion_tokens == len(expected)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens


@pytest.fixture(scope="module")
def greedy_completion(client, model):
    return client.completions.create(model=model, prompt=PROMPTS[3], max_tokens=10, temperature=0, logprobs=2,
                                     extra_body={"ignore_eos": True})


def test_completion_stops_at_max_tokens(greedy_completion, tokenizer):
    c = greedy_completion
    assert c.object == "text_completion" and c.id.startswith("cmpl-")
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 10
    assert c.usage.prompt_tokens == len(tokenizer.encode(PROMPTS[3]))
    assert len(c.choices[0].logprobs.tokens) == 10 and "".join(c.choices[0].logprobs.tokens) == c.choices[0].text


def test_completion_logprobs_shapes(greedy_completion):
    lp = greedy_completion.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 2 and logprob <= 0
        assert max(top.values()) == pytest.approx(logprob) and top[token] == pytest.approx(logprob)  # greedy
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]


def test_token_id_prompts_equal_text_prompts(client, model, tokenizer, greedy_completion):
    ids = tokenizer.encode(PROMPTS[3])
    c = client.completions.create(model=model, prompt=ids, max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert c.choices[0].text == greedy_completion.choices[0].text


def test_stop_strings_are_cut_out(client, model, greedy_completion):
    text = greedy_completion.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]  # a piece of what greedy decoding writes anyway
    ask = dict(model=model, prompt=PROMPTS[3], max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    c = client.completions.create(stop=[stop], **ask)
    assert c.choices[0].text == text[:text.find(stop)] and c.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(stop=stop, stream=True, **ask))
    assert "".join(ch.choices[0].text for ch in streamed) == c.choices[0].text


def test_n_choices_are_indexed_and_each_finishes_once(client, model):
    whole = client.chat.completions.create(model=model, messages=QUESTION, n=3, max_tokens=4, temperature=1.0,
                                           seed=5)
    assert sorted(c.index for c in whole.choices) == [0, 1, 2]
    assert 3 <= whole.usage.completion_tokens <= 3 * 4
    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, n=2, max_tokens=4,
                                                 temperature=1.0, seed=5, stream=True))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert sum(c.finish_reason is not None for c in mine) == 1 and mine[-1].finish_reason is not None
    # a seeded request repeats itself, choice by choice, streamed or not
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) for i in (0, 1)]
    assert texts == [whole.choices[0].message.content, whole.choices[1].message.content]


def test_chat_logprobs_shapes(client, model):
    r = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=5, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert e.top_logprobs[0].token == e.token and e.logprob == pytest.approx(tops[0])  # greedy: the top one
        assert bytes(e.bytes).decode() == e.token


def test_seed_reproduces_a_sampled_answer(client, model):
    ask = dict(model=model, messages=QUESTION, temperature=1.0, max_tokens=8, seed=1234)
    first = client.chat.completions.create(**ask).choices[0].message.content
    assert client.chat.completions.create(**ask).choices[0].message.content == first


def test_extra_body_parameters_are_honoured(client, model, chat_whole_and_streamed):
    greedy = chat_whole_and_streamed[0].choices[0].message.content
    top1 = client.chat.completions.create(model=model, messages=QUESTION, temperature=1.0, max_tokens=12,
                                          extra_body={"top_k": 1})
    assert top1.choices[0].message.content == greedy  # top_k=1 leaves nothing to sample but the argmax
    on = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_completion_tokens=11,
                                        extra_body={"ignore_eos": True})
    assert on.choices[0].finish_reason == "length" and on.usage.completion_tokens == 11
    assert on.choices[0].message.content.startswith(greedy)


def test_bad_requests_raise_the_clients_errors(client, model, server):
    with pytest.raises(openai.BadRequestError, match="temperature must be") as e:
        client.chat.completions.create(model=model, messages=QUESTION, temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    too_long = r"maximum context length is \d+ tokens.*requested 100\d\d tokens"
    with pytest.raises(openai.BadRequestError, match=too_long):
        client.completions.create(model=model, prompt="hi", max_tokens=10_000)
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: frobnicate"):
        client.completions.create(model=model, prompt="hi", extra_body={"frobnicate": 1})
    with pytest.raises(openai.BadRequestError, match="messages must be a non-empty list"):
        client.chat.completions.create(model=model, messages=[])
    assert_all_blocks_free(server)


def test_the_engines_rejections_become_400s_naming_this_requests_field(server, model):
    """The engine alone checks a request against its limits; its RequestRejected carries the field and
    OpenAI's code, and each endpoint names the field as its client sent it."""
    limit = server.app.state.client.engine.stats().max_model_len
    question = {"model": model, "messages": QUESTION}
    cases = [  # (path, body, param, code)
        ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": limit}, "max_tokens",
         "context_length_exceeded"),
        ("/v1/chat/completions", {**question, "max_completion_tokens": limit}, "max_completion_tokens",
         "context_length_exceeded"),
        ("/v1/chat/completions", {**question, "max_tokens": limit}, "max_tokens", "context_length_exceeded"),
        ("/v1/completions", {"model": model, "prompt": [7] * limit}, "prompt", "context_length_exceeded"),
        ("/v1/chat/completions", {**question, "messages": [{"role": "user", "content": "word " * limit}]},
         "messages", "context_length_exceeded"),
        ("/v1/completions", {"model": model, "prompt": "hi", "n": 33}, "n", None),
        ("/v1/chat/completions", {**question, "stop_token_ids": [10**9]}, "stop_token_ids", None),
    ]
    with httpx.Client(base_url=server.url, timeout=None) as http:
        for path, body, param, code in cases:
            response = http.post(path, json=body)
            assert response.status_code == 400, (path, body, response.text)
            error = response.json()["error"]
            assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error"), error
    assert_all_blocks_free(server)


def test_models_advertises_the_engines_limit(client, server):
    stats = server.app.state.client.engine.stats()
    assert client.models.list().data[0].model_extra["max_model_len"] == stats.max_model_len
    assert stats.max_model_len == min(server.app.state.client.engine.model.config.context_length,
                                      stats.num_blocks * stats.block_size)


def test_an_engine_failure_mid_stream_reaches_the_client_as_an_error(client, model, server, monkeypatch):
    engine = server.app.state.client.engine

    def failing_step():
        raise RuntimeError("injected failure")

    stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=200, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    with pytest.raises(openai.APIError, match="internal error in the engine: RuntimeError: injected failure"):
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                monkeypatch.setattr(engine, "step", failing_step)  # the stream has started: break the engine
    monkeypatch.undo()
    assert_all_blocks_free(server)
    again = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=12)
    assert again.choices[0].message.content == "The capital of France is Paris."


# -----------------------------------------------------------------------------------------------
# Concurrency, disconnects, back-pressure, bad input


async def streamed_greedy_text(http: httpx.AsyncClient, model: str, prompt: str) -> str:
    """The text of a streamed greedy completion of 6 tokens, joined from its SSE events."""
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}
    text = ""
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_32_concurrent_streams_give_the_one_by_one_greedy_texts(client, model, server):
    ask = dict(model=model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **ask).choices[0].text for p in PROMPTS]

    async def all_at_once() -> list[str]:
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(base_url=server.url, timeout=None, limits=limits) as http:
            return await asyncio.gather(*(streamed_greedy_text(http, model, p) for p in PROMPTS * 4))

    assert asyncio.run(all_at_once()) == alone * 4
    assert_all_blocks_free(server)


def leave_a_long_stream(url: str, model: str, while_streaming: Callable[[], None]) -> None:
    """Start a long greedy completion stream, read 3 of its events, call ``while_streaming``, hang up.

    The line iterator is held until the hang-up: a ``for`` over ``response.iter_lines()`` that breaks
    drops it, and closing that generator closes the connection - the client would hang up before
    ``while_streaming`` runs, racing the server's abort against the test's look at the running request."""
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 500, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=None) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            events, lines = [], response.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line)
                if len(events) == 3:
                    break
            assert len(events) == 3, f"the stream ended early ({response.status_code}): {events}"
            assert all('"choices"' in event for event in events), f"not three token chunks: {events}"
            while_streaming()


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server, model):
    engine = server.app.state.client.engine

    def running():
        stats = engine.stats()
        assert stats.num_running == 1 and stats.kv_cache_usage > 0

    leave_a_long_stream(server.url, model, running)
    # the connection is closed: the server notices, aborts the request and frees its blocks
    wait_until(lambda: read_metrics(server)[("minillm:num_requests_running", None)] == 0, "running drops to 0")
    wait_until(lambda: read_metrics(server)[("minillm:kv_cache_usage_perc", None)] == 0, "KV usage drops to 0")
    assert_all_blocks_free(server)


def test_a_full_waiting_queue_answers_503(server, model, monkeypatch):
    async_engine, engine = server.app.state.client, server.app.state.client.engine
    real_step, entered, gate = engine.step, threading.Event(), threading.Event()

    def held_step():  # the engine thread stops here until the test lets it go
        entered.set()
        gate.wait()
        return real_step()

    monkeypatch.setattr(engine, "step", held_step)
    monkeypatch.setattr(async_engine, "max_waiting", 2)
    monkeypatch.setattr(engine.scheduler, "max_num_seqs", 1)        # one runs, the others really wait
    body = {"model": model, "prompt": PROMPTS[1], "max_tokens": 3, "temperature": 0}

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=None) as http:
            first = asyncio.ensure_future(http.post("/v1/completions", json=body))
            await asyncio.to_thread(entered.wait, 300)               # 1 accepted, to run; the engine is held
            waiting = [asyncio.ensure_future(http.post("/v1/completions", json=body)) for _ in range(2)]
            while async_engine.num_waiting < 2:                     # 2 waiting: the queue is full
                await asyncio.sleep(0.01)
            third = await http.post("/v1/completions", json=body)
            gate.set()
            return await first, (await waiting[0], await waiting[1])[0], third

    first, second, third = asyncio.run(scenario())
    assert third.status_code == 503
    error = third.json()["error"]
    assert "overloaded" in error["message"] and error["type"] == "server_error"
    assert first.status_code == second.status_code == 200
    assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]
    assert_all_blocks_free(server)


MALFORMED = [
    ("POST", "/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("POST", "/v1/chat/completions", {"messages": QUESTION, "max_tokens": "ten"}, 400, "max_tokens"),
    ("POST", "/v1/chat/completions", {"messages": QUESTION, "n": 10_000}, 400, "max_num_seqs"),
    ("POST", "/v1/chat/completions", {"messages": QUESTION, "max_tokens": -5}, 400, "max_tokens must be"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "content"),
    ("POST", "/v1/chat/completions", {"messages": QUESTION, "stop_token_ids": [10**9]}, 400, "outside the vocabulary"),
    ("POST", "/v1/completions", {"prompt": "word " * 9000}, 400, "maximum context length"),
    ("POST", "/v1/completions", {"prompt": [1, 2, -7]}, 400, "outside the vocabulary"),
    ("POST", "/v1/completions", {"prompt": ["one", "two"]}, 400, "one prompt per request"),
    ("POST", "/v1/completions", {"prompt": ""}, 400, "prompt is empty"),
    ("POST", "/v1/completions", {"prompt": "hi", "model": "no-such-model"}, 404, "does not exist"),
    ("POST", "/v1/embeddings", {"input": "hi"}, 404, "Invalid URL (POST /v1/embeddings)"),
    ("GET", "/v1/completions", None, 405, "Method Not Allowed"),
]


def test_malformed_requests_get_openai_errors_and_the_server_carries_on(server, client, model):
    with httpx.Client(base_url=server.url, timeout=None) as http:
        for method, path, body, status, words in MALFORMED:
            if isinstance(body, dict):
                body = json.dumps({"model": model, **body}).encode()
            response = http.request(method, path, content=body, headers={"Content-Type": "application/json"})
            assert response.status_code == status, (path, body, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and words in error["message"], error
    assert_all_blocks_free(server)
    ok = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=12)
    assert ok.choices[0].message.content == "The capital of France is Paris."


def test_metrics_count_what_happened(server, client, model):
    for max_tokens in (12, 2):  # ends by eos, then by length; the second finds the first's prompt cached
        client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=max_tokens)
    assert_all_blocks_free(server)
    m = read_metrics(server)
    assert m[("minillm:generation_tokens_total", None)] > 0 and m[("minillm:prompt_tokens_total", None)] > 0
    assert m[("minillm:request_success_total", "length")] > 0 and m[("minillm:request_success_total", "stop")] > 0
    assert m[("minillm:time_to_first_token_seconds_count", None)] > 0
    assert m[("minillm:inter_token_latency_seconds_count", None)] > 0
    assert m[("minillm:e2e_request_latency_seconds_sum", None)] > 0
    assert m[("minillm:request_queue_time_seconds_count", None)] > 0
    assert 0 < m[("minillm:prefix_cache_hits_total", None)] <= m[("minillm:prefix_cache_queries_total", None)]
    assert m[("minillm:num_requests_running", None)] == 0 and m[("minillm:num_requests_waiting", None)] == 0


# -----------------------------------------------------------------------------------------------
# The load generator against this server


def test_loadgen_measures_a_tiny_run(server, llm):
    config = LoadConfig(base_url=server.url, num_prompts=4, input_len=20, output_len=4, max_concurrency=2,
                        goodput={"ttft": 1e9}, progress=False)
    report = asyncio.run(benchmark(config, llm.tokenizer))
    s = report.summary
    assert (s["completed"], s["failed"]) == (4, 0) and s["tokens_from_usage"]
    assert s["total_input_tokens"] == 4 * 20 and s["total_output_tokens"] == 4 * 4
    assert s["request_goodput"] == pytest.approx(s["request_throughput"])  # a target nobody misses
    for r in report.requests:
        lat = r.latencies
        assert 0 < lat.ttft <= lat.e2e and lat.tpot > 0 and len(lat.itl) <= 3
    for key, value in s.items():
        if key.startswith(("mean_", "median_", "p99_")) or key.endswith("_throughput"):
            assert value > 0 and value < float("inf"), key
    assert "Serving Benchmark Result" in report.table()
    assert_all_blocks_free(server)


def test_shutdown_finishes_in_flight_requests_then_stops_the_engine(smollm2_path, model):
    llm = LLM(smollm2_path, max_num_seqs=4, kv_cache_bytes=16 << 20)
    server = BackgroundServer(llm_app(llm)).start()
    async_engine = server.app.state.client
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=None) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = iter(response.iter_lines())
            assert next(lines).startswith("data: ")          # the request is in flight
            stopper = threading.Thread(target=server.stop)
            stopper.start()                                  # Ctrl-C, in effect
            rest = [line for line in lines if line]
    stopper.join()
    assert rest[-1] == "data: [DONE]"
    texts = [json.loads(line[6:])["choices"][0] for line in rest[:-1]]
    assert texts[-1]["finish_reason"] == "length"
    assert not async_engine.thread.is_alive()
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_bench_serve_command_line(server, smollm2_path, tmp_path, capsys):
    out = tmp_path / "serve.json"
    assert loadgen_main(["--base-url", server.url, "--tokenizer", str(smollm2_path), "--num-prompts", "2",
                         "--input-len", "8", "--output-len", "3", "--request-rate", "5", "--goodput", "ttft:1e9",
                         "--save-json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert (summary["completed"], summary["total_output_tokens"], summary["config"]["request_rate"]) == (2, 6, 5.0)
    assert "Request goodput (req/s)" in capsys.readouterr().out
