"""`minillm serve` as an operator runs it: API keys, the access log, limits, failure isolation, signals.

The model-using tests serve the real SmolLM2 over real HTTP; the signal tests start the `minillm
serve` command itself and signal it as systemd or `docker stop` would.
"""
import asyncio
import json
import logging
import os
import signal
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest
from openai import OpenAI

from minillm.cli import main as cli_main
from minillm.llm import LLM
from minillm.runtime.engine import LLMEngine
from minillm.serve import auth
from minillm.serve.app import BackgroundServer, llm_app
from minillm.serve.config import ServerConfig
from serve_process import serve_process

KEY = "sekrit-key"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


# -----------------------------------------------------------------------------------------------
# Without the model


def test_the_api_key_comes_from_the_flag_else_the_environment(monkeypatch):
    monkeypatch.setenv(auth.API_KEY_ENV, "from-env")
    assert auth.resolve_api_key("from-flag") == "from-flag"
    assert auth.resolve_api_key(None) == "from-env"
    monkeypatch.setenv(auth.API_KEY_ENV, "")
    assert auth.resolve_api_key(None) is None  # empty: an open server, not a key of ""
    with pytest.raises(ValueError, match="--protect-metrics needs an API key"):
        auth.resolve_api_key(None, protect_metrics=True)


@pytest.mark.parametrize("flags, message", [(["--threads", "0"], "--threads must be >= 1"),
                                            (["--protect-metrics"], "--protect-metrics needs an API key")])
def test_bad_operator_flags_fail_before_the_model_loads(flags, message, capsys, monkeypatch):
    monkeypatch.delenv(auth.API_KEY_ENV, raising=False)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # --threads writes the environment: keep ours
    assert cli_main(["serve", "--model", "/nonexistent.gguf", *flags]) == 2
    assert message in capsys.readouterr().err


# -----------------------------------------------------------------------------------------------
# One model, several servers (one at a time: an engine serves one app)


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path, max_num_seqs=8, kv_cache_bytes=64 << 20)


@contextmanager
def serving(llm, **options):
    with BackgroundServer(llm_app(llm, ServerConfig(**options))) as server:
        yield server


def all_blocks_free(server, timeout: float = 120.0) -> bool:
    engine, deadline = server.app.state.client.engine, time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if not engine.has_unfinished() and not server.app.state.client.streams and \
                stats.num_free_blocks == stats.num_blocks:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_the_api_key_guards_v1_and_nothing_else(llm):
    with serving(llm, api_key=KEY) as server:
        def client(key):
            return OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)

        with pytest.raises(openai.AuthenticationError) as wrong:
            client("not-the-key").models.list()
        assert wrong.value.status_code == 401
        assert wrong.value.body == {"message": "Incorrect API key provided.", "type": "invalid_request_error",
                                    "param": None, "code": "invalid_api_key"}
        missing = httpx.post(server.url + "/v1/chat/completions", json={"messages": QUESTION})
        assert missing.status_code == 401 and "Missing API key" in missing.json()["error"]["message"]
        assert [m.id for m in client(KEY).models.list().data] == [server.app.state.model_name]
        for open_path in ("/health", "/metrics", "/"):  # probes, scrapers and the chat page need no key
            assert httpx.get(server.url + open_path).status_code == 200, open_path

    with serving(llm, api_key=KEY, protect_metrics=True) as server:
        assert httpx.get(server.url + "/metrics").status_code == 401
        metrics = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert metrics.status_code == 200 and "minillm:kv_cache_usage_perc" in metrics.text


@pytest.mark.slow
def test_each_request_gets_one_access_log_line(llm, caplog):
    caplog.set_level(logging.INFO, logger="minillm.access")
    with serving(llm, api_key=KEY) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        chunks = list(client.chat.completions.create(
            model=server.app.state.model_name, messages=QUESTION, max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        httpx.get(server.url + "/v1/models")  # no key: a 401 has its line too
        usage, request_id = chunks[-1].usage, chunks[0].id
    lines = [r.getMessage() for r in caplog.records if r.name == "minillm.access"]
    (chat,) = [line for line in lines if request_id in line]
    fields = dict(part.split("=", 1) for part in chat.split() if "=" in part)
    assert '"POST /v1/chat/completions" 200' in chat
    assert (int(fields["prompt_tokens"]), int(fields["output_tokens"])) == (usage.prompt_tokens, 4)
    assert 0 < float(fields["ttft"].rstrip("s")) <= float(fields["total"].rstrip("s"))
    assert any('"GET /v1/models" 401' in line for line in lines)


@pytest.mark.slow
def test_limits_per_request_timeout_and_tokens(llm):
    with serving(llm, request_timeout=1.0, max_request_tokens=1200) as server:
        model, url = server.app.state.model_name, server.url
        too_many = httpx.post(url + "/v1/chat/completions", json={"model": model, "messages": QUESTION, "n": 2,
                                                                 "max_completion_tokens": 700})
        assert too_many.status_code == 400
        assert too_many.json()["error"]["param"] == "max_completion_tokens"
        assert "2 x 700 = 1400 tokens exceeds" in too_many.json()["error"]["message"]

        long = {"model": model, "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True}
        started = time.monotonic()
        whole = httpx.post(url + "/v1/completions", json=long, timeout=120)
        assert whole.status_code == 504, whole.text
        assert "request timeout (1.0 s)" in whole.json()["error"]["message"]
        assert time.monotonic() - started < 60  # aborted, not run to its 1000 tokens
        with httpx.stream("POST", url + "/v1/completions", json={**long, "stream": True}, timeout=120) as streamed:
            events = [json.loads(line[6:]) for line in streamed.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert "request timeout" in events[-1]["error"]["message"]
        assert all_blocks_free(server)


@pytest.mark.slow
def test_max_model_len_caps_the_context(llm):
    original = llm.engine
    with pytest.raises(ValueError, match=r"max_model_len must be in \[1, "):  # longer than the context
        LLMEngine(llm.model, llm.tokenizer, max_model_len=llm.model.config.context_length + 1)
    llm.engine = LLMEngine(llm.model, llm.tokenizer, max_model_len=64)  # what `--max-model-len 64` builds
    try:
        with serving(llm) as server:
            model = server.app.state.model_name
            listed = httpx.get(server.url + "/v1/models").json()["data"][0]
            assert listed["max_model_len"] == 64
            over = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 64})
            assert over.status_code == 400 and "maximum context length is 64 tokens" in over.json()["error"]["message"]
    finally:
        llm.engine = original


# -----------------------------------------------------------------------------------------------
# A request that breaks the engine fails alone


POISON = "Please break the engine now."


@pytest.mark.slow
def test_a_request_that_breaks_the_engine_fails_alone(llm, monkeypatch):
    """The test hook: a step (or an add) raises while a request with the poisoned prompt is in the
    engine - as a bug triggered by one request's data would. That request gets a 500; the
    requests around it, before and after, finish with exactly their greedy texts."""
    engine = llm.engine
    poison = llm.tokenizer.encode(POISON)
    real_step, real_add = engine.step, engine.add_request

    def poisoned_step():
        if any(r.prompt_ids == poison for r in engine.requests.values()):
            raise RuntimeError("poisoned step")
        return real_step()

    def poisoned_add(prompt_ids, params, **kwargs):
        if prompt_ids == poison and params.max_tokens == 3:
            raise KeyError("poisoned add")
        return real_add(prompt_ids, params, **kwargs)

    with serving(llm) as server:
        model, url = server.app.state.model_name, server.url
        ask = {"model": model, "temperature": 0, "ignore_eos": True}
        prompts = ["Once upon a time", "The three primary colors are"]
        alone = [httpx.post(url + "/v1/completions", json={**ask, "prompt": p, "max_tokens": 8}, timeout=300)
                 .json()["choices"][0]["text"] for p in prompts]
        monkeypatch.setattr(engine, "step", poisoned_step)
        monkeypatch.setattr(engine, "add_request", poisoned_add)

        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=300) as http:
                async def stream(prompt):  # a request already running when the poison arrives
                    text = ""
                    async with http.stream("POST", "/v1/completions",
                                           json={**ask, "prompt": prompt, "max_tokens": 8, "stream": True}) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: ") and line != "data: [DONE]":
                                text += json.loads(line[6:])["choices"][0]["text"]
                                started.set()
                    return text

                def post(prompt, max_tokens=6):
                    return http.post("/v1/completions", json={**ask, "prompt": prompt, "max_tokens": max_tokens})

                started = asyncio.Event()
                running = asyncio.ensure_future(stream(prompts[0]))
                await started.wait()
                # the poison, alone and then together with an innocent newcomer; an add that raises
                poisoned_alone = await post(poison)
                poisoned, innocent = await asyncio.gather(post(poison), post(prompts[1], 8))
                bad_add = await post(poison, max_tokens=3)
                return await running, poisoned_alone, poisoned, innocent, bad_add

        running_text, poisoned_alone, poisoned, innocent, bad_add = asyncio.run(scenario())
        for response, message in ((poisoned_alone, "poisoned step"), (poisoned, "poisoned step"),
                                  (bad_add, "poisoned add")):
            assert response.status_code == 500, response.text
            assert message in response.json()["error"]["message"]
            assert response.json()["error"]["type"] == "server_error"
        assert running_text == alone[0]
        assert innocent.status_code == 200 and innocent.json()["choices"][0]["text"] == alone[1]
        assert httpx.get(url + "/health").status_code == 200 and server.app.state.client.thread.is_alive()
        assert all_blocks_free(server)


# -----------------------------------------------------------------------------------------------
# Signals: the `minillm serve` process itself


def first_lines_then_signal(url: str, process, body: dict, signals: list[int]) -> list[str]:
    """Stream a completion; after its first event, send ``signals`` (1 s apart); return every line read."""
    lines = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            lines.append(line)
            if len(lines) == 1:
                for i, sig in enumerate(signals):
                    time.sleep(1.0 if i else 0.0)
                    process.send_signal(sig)
    return lines


@pytest.mark.slow
def test_sigterm_drains_the_requests_in_flight_then_exits_0(smollm2_path):
    with serve_process(smollm2_path, "--served-model-name", "smol", "--drain-timeout", "120") as (process, url):
        body = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True, "stream": True}
        refused = []

        def probe():  # while draining, the port takes no new connections
            time.sleep(0.5)
            try:
                httpx.get(url + "/health", timeout=5)
            except httpx.TransportError:
                refused.append(True)

        prober = threading.Thread(target=probe)
        lines = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
            for line in response.iter_lines():
                if line and not lines:
                    process.send_signal(signal.SIGTERM)
                    prober.start()
                lines += [line] if line else []
        prober.join()
        assert process.wait(timeout=120) == 0
        events = [json.loads(line[6:]) for line in lines[:-1]]
        assert lines[-1] == "data: [DONE]" and events[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(e["choices"][0]["text"] for e in events)  # the whole answer came through
        assert refused == [True]
        log = process.stdout.read()
        assert "SIGTERM: no new connections" in log
        assert '"POST /v1/completions" 200' in log and "output_tokens=8" in log


@pytest.mark.slow
def test_a_second_signal_exits_at_once(smollm2_path):
    with serve_process(smollm2_path, "--drain-timeout", "600") as (process, url):
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "stream": True}
        started = time.monotonic()
        with pytest.raises(httpx.RemoteProtocolError):  # the connection dies with the process
            first_lines_then_signal(url, process, body, [signal.SIGTERM, signal.SIGINT])
        assert process.wait(timeout=60) == 1
        assert time.monotonic() - started < 60  # not the 600 s drain, nor the 500 tokens
        assert "SIGINT again: exiting now" in process.stdout.read()


# -----------------------------------------------------------------------------------------------
# The body-size limit (a tiny app: no model needed)


def test_a_body_over_the_limit_gets_a_413_before_the_route_reads_it():
    from fastapi import FastAPI, Request
    from fastapi.testclient import TestClient

    from minillm.serve import body_limit

    app, seen = FastAPI(), []

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        seen.append(len(await request.body()))
        return {"bytes": seen[-1]}

    body_limit.install(app, max_bytes=1000)
    client = TestClient(app)
    assert client.post("/echo", content=b"x" * 1000).json() == {"bytes": 1000}
    declared = client.post("/echo", content=b"x" * 1001)
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"
    chunked = client.post("/echo", content=iter([b"x" * 600, b"x" * 600]))  # no Content-Length
    assert chunked.status_code == 413 and "limit of 1000 bytes" in chunked.json()["error"]["message"]
    assert seen == [1000]  # the route never got an oversized body
