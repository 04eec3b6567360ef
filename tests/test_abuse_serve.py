"""Issue 27, findings 5-10: what the serving layer let through, each replayed against a real server.

One test (or a small group) per finding, each failing on f0bbb69: two constraints in one request,
errors and sockets of ``--replicas``, the drain deadline, tool definitions and cut tool calls, the
speculative config, and the page's headers with the ``Host`` check. The constraint compiler's own
findings (1-4) are tested beside its code.
"""
import json
import re
import signal

import httpx
import pytest

from minillm.generation.constrained.examples import WEATHER_CALL
from minillm.llm import LLM
from minillm.runtime.speculative import SpeculativeConfig
from minillm.serve.app import BackgroundServer, llm_app
from minillm.serve.config import ServerConfig
from serve_process import serve_process

CHAT = [{"role": "user", "content": "What's the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_CALL}}
REQUIRED = {"tools": [WEATHER], "tool_choice": "required"}


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path, max_num_seqs=4, kv_cache_bytes=32 << 20, max_n=2)


@pytest.fixture(scope="module")
def server(llm):
    with BackgroundServer(llm_app(llm, ServerConfig(log_interval=60.0))) as server:
        yield server


def chat(server, model, **fields) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", timeout=120,
                      json={"model": model, "messages": CHAT, "max_tokens": 4, **fields})


def assert_400(response: httpx.Response, param: str, *words: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and all(w in error["message"] for w in words), error
    return error


# -----------------------------------------------------------------------------------------------
# 5. One constraint per request


@pytest.mark.slow
@pytest.mark.parametrize("fields, named", [
    ({"guided_json": {"type": "string"},
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}},
     ("response_format", "guided_json")),
    ({"guided_regex": "yes|no", **REQUIRED}, ("tools", "guided_regex")),
    ({"guided_choice": ["yes"], "tools": [WEATHER]}, ("tools", "guided_choice")),   # "auto" constrains too
    ({"guided_regex": "a+", "guided_json": {"type": "string"}}, ("guided_regex", "guided_json")),
    ({"response_format": {"type": "json_object"}, **REQUIRED}, ("tools", "response_format")),
])
def test_two_constraints_in_one_request_are_a_400_naming_both(server, model, fields, named):
    assert_400(chat(server, model, **fields), named[1], *named)  # before: 200, one of them silently dropped


@pytest.mark.slow
def test_two_constraints_in_one_completion_are_a_400_naming_both(server, model):
    response = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": "Hi", "max_tokens": 2, "guided_choice": ["a"], "guided_regex": "b"})
    assert_400(response, "guided_choice", "guided_regex", "guided_choice")


# -----------------------------------------------------------------------------------------------
# 8. Tools validated as OpenAI does; a cut call is reported as one, never as raw content


def tool(name: str, parameters: dict | None = None) -> dict:
    function = {"name": name, **({"parameters": parameters} if parameters is not None else {})}
    return {"type": "function", "function": function}


@pytest.mark.slow
@pytest.mark.parametrize("tools, param, words", [
    ([tool("")], "tools[0].function.name", "does not match"),
    ([tool("get weather; rm -rf")], "tools[0].function.name", "does not match"),
    ([tool("</tool_call><|im_end|>")], "tools[0].function.name", "does not match"),
    ([tool("a" * 65)], "tools[0].function.name", "does not match"),
    ([tool("ok"), tool("get_weather"), tool("get_weather")], "tools[2].function.name", "unique"),
    ([tool("ok"), tool("f", {"type": "string"})], "tools[1].function.parameters", '"object"'),
    ([tool("f", {"properties": {}})], "tools[0].function.parameters", '"object"'),
])
def test_bad_tool_definitions_are_a_400_naming_the_field(server, model, tools, param, words):
    assert_400(chat(server, model, tools=tools), param, words)
    assert_400(chat(server, model, tools=tools, tool_choice="none"), param, words)  # checked even unused


@pytest.mark.slow
def test_good_tool_definitions_pass(server, model):
    tools = [tool("A-z_09" + "x" * 58), tool("no_arguments"), tool("empty", {}), WEATHER]
    assert chat(server, model, tools=tools, tool_choice="none").status_code == 200


def streamed_chunks(server, model, **fields) -> list[dict]:
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120, json={
            "model": model, "messages": CHAT, "stream": True, **fields}) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.slow
def test_a_forced_call_cut_by_max_tokens_is_a_cut_call_not_content(server, model):
    full = chat(server, model, **REQUIRED, max_tokens=60, temperature=0).json()["choices"][0]
    assert full["finish_reason"] == "tool_calls"  # the oracle: the same greedy call, not cut
    # 20 tokens reach into the arguments (the tag and the name take 16, the whole call 35)
    whole = chat(server, model, **REQUIRED, max_tokens=20, temperature=0).json()
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None, choice
    assert "<tool_call>" not in json.dumps(whole)  # before: the raw '<tool_call>{"name": ...' as content
    assert whole["usage"]["completion_tokens"] == 20
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == full["message"]["tool_calls"][0]["function"]["name"]
    with pytest.raises(json.JSONDecodeError):
        json.loads(call["function"]["arguments"])   # cut: the finish reason says so, the arguments show it
    assert full["message"]["tool_calls"][0]["function"]["arguments"].startswith(call["function"]["arguments"])

    chunks = streamed_chunks(server, model, **REQUIRED, max_tokens=20, temperature=0)
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert not any(d["delta"].get("content") for d in deltas) and "<tool_call>" not in json.dumps(chunks)
    assert [d["finish_reason"] for d in deltas if d["finish_reason"]] == ["length"]
    streamed = [tc for d in deltas for tc in d["delta"].get("tool_calls", [])]
    assert [tc["function"] for tc in streamed] == [call["function"]]


@pytest.mark.slow
def test_a_forced_call_cut_by_a_stop_string_is_no_content(server, model):
    whole = chat(server, model, **REQUIRED, max_tokens=40, temperature=0, stop=['"location"']).json()
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None, choice
    assert "<tool_call>" not in json.dumps(whole)
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": "{"}


# -----------------------------------------------------------------------------------------------
# 9. The speculative config, field by field


@pytest.mark.parametrize("options, words", [
    ({"num_speculative_tokens": 1000}, "num_speculative_tokens must be an integer in [1, 16], got 1000"),
    ({"num_speculative_tokens": 17}, "num_speculative_tokens must be an integer in [1, 16]"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens must be an integer in [1, 16], got True"),
    ({"num_speculative_tokens": "4"}, "num_speculative_tokens must be an integer in [1, 16], got '4'"),
    ({"prompt_lookup_min": "2"}, "prompt_lookup_min must be an integer >= 1, got '2'"),
    ({"prompt_lookup_max": 2.0}, "prompt_lookup_max must be an integer >= 1, got 2.0"),
    ({"min_acceptance_rate": "0.5"}, "min_acceptance_rate must be a number in [0, 1], got '0.5'"),
    ({"min_acceptance_rate": True}, "min_acceptance_rate must be a number in [0, 1], got True"),
    ({"min_drafts": "8"}, "min_drafts must be an integer >= 0, got '8'"),
    ({"method": "self", "num_draft_layers": "3"}, "num_draft_layers must be an integer >= 1, got '3'"),
])
def test_a_bad_speculative_field_is_named(options, words):
    with pytest.raises(ValueError, match=re.escape(words)):  # before: accepted, or a TypeError naming nothing
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, **options})


def test_the_speculative_bounds_are_inclusive():
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 16}).num_speculative_tokens == 16
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 1}).num_speculative_tokens == 1


# -----------------------------------------------------------------------------------------------
# 6. --replicas: one-sentence errors across the Ray boundary; what Ray listens on

RAY_TRACEBACK = ('\x1b[36mray::ServeReplica:minillm-replica-0:EngineReplica.generate()\x1b[39m (pid=4242, '
                 'ip=10.1.2.3, actor_id=5f1c0ffee, repr=<minillm.serve.replicas.EngineReplica object>)\n'
                 'Traceback (most recent call last):\n  File "/home/user/minillm/serve/async_engine.py", line 99')


def assert_one_sentence(message: str) -> None:
    assert "\n" not in message and "\x1b" not in message and "Traceback" not in message, message
    assert not any(leak in message for leak in ("pid=", "ip=", "actor_id", "/home/", ".py")), message


class FakeCall:
    """What ``handle.options(stream=True).generate.remote(...)`` gives the front: Ray Serve's stream
    of a replica's items - ``items`` (an exception among them is raised, as Ray raises a failed
    call), then a replica still generating, until ``cancel()``."""

    def __init__(self, items):
        import asyncio

        self.items, self.cancelled = list(items), asyncio.Event()

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items:
            item = self.items.pop(0)
            if isinstance(item, Exception):
                raise item
            return item
        await self.cancelled.wait()
        raise StopAsyncIteration

    def cancel(self):
        self.cancelled.set()


class FakeHandle:
    """A replica's Ray Serve handle, as ``ReplicaSet`` calls it; ``calls``: every call made."""

    def __init__(self, items):
        self.items, self.calls = items, []

    def options(self, stream: bool):
        return self

    @property
    def generate(self):
        return self

    def remote(self, prompt_ids, params, request_id):
        self.calls.append(FakeCall(self.items))
        return self.calls[-1]


def fake_replicas(items, vocab_size: int = 49152):
    """A ``ReplicaSet`` of one fake replica that sends ``items``."""
    from minillm.runtime.config import EngineLimits
    from minillm.runtime.engine import EngineStats
    from minillm.serve.metrics import ServerMetrics
    from minillm.serve.replicas import ReplicaSet

    limits = EngineLimits(max_model_len=2048, max_n=2, max_num_seqs=4, block_size=16, vocab_size=vocab_size)
    idle = EngineStats(0, 0, 0, 0.0, 128, 128, 0, 0, 0, limits.max_model_len, limits.max_num_seqs, 512,
                       limits.block_size)
    return ReplicaSet([FakeHandle(items)], limits, "round-robin", ServerMetrics("fake", idle)), limits


def test_a_failed_ray_call_reaches_the_client_as_one_sentence():
    import asyncio

    from minillm.generation.sampling import SamplingParams
    from minillm.serve.client import EngineFailure

    class RayTaskError(Exception):  # Ray's exceptions carry the remote traceback as their text
        pass

    replicas, _ = fake_replicas([RayTaskError(RAY_TRACEBACK)])

    async def submit():
        with pytest.raises(EngineFailure) as failure:
            await replicas.submit([1, 2], SamplingParams(), "r", 0.0)
        return str(failure.value)

    message = asyncio.run(submit())
    assert message.startswith("the replica serving this request failed") and "RayTaskError" in message
    assert_one_sentence(message)  # before: the whole traceback, paths, pid, ip, actor id, colours
    assert replicas.in_flight == [0] and not replicas.calls


def test_stopping_the_replica_set_ends_each_stream_with_the_engines_error_event_and_done(smollm2_path):
    """The drain deadline calls ``client.stop()`` from a thread of its own. With replicas, before, it
    only set a flag: the stream hung until the replicas were deleted or uvicorn cut it mid-chunk.
    Now it ends as the single engine's does (an error event, then [DONE]) and the Ray call is
    cancelled, so the replica aborts the request."""
    import threading

    from minillm.llm import load_tokenizer
    from minillm.runtime.engine import StepOutput
    from minillm.serve.app import create_app
    from minillm.serve.client import ACCEPTED

    tokenizer = load_tokenizer(smollm2_path)
    token = StepOutput("r", 0, 42, "Once", None, True, False, None, False)
    replicas, limits = fake_replicas([ACCEPTED, [token]], tokenizer.vocab_size)
    body = {"model": "fake", "prompt": "Once upon a time", "max_tokens": 400, "stream": True}
    with BackgroundServer(create_app(replicas, tokenizer, limits, "fake")) as server:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            events = []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:  # the replica's first token is out: the deadline strikes
                        threading.Thread(target=replicas.stop).start()
    assert events[-1] == "[DONE]", events
    assert json.loads(events[0])["choices"][0]["text"] == "Once"
    error = json.loads(events[-2])["error"]
    assert error["message"] == "the server is shutting down" and error["type"] == "server_error", error
    call = replicas.handles[0].calls[0]
    assert call.cancelled.is_set() and replicas.in_flight == [0] and not replicas.calls


@pytest.mark.parametrize("where", ["submit", "stream"])
def test_a_replicas_failure_leaves_as_the_single_engines_refusal(where):
    """Whatever fails inside a replica comes back as a Refusal value with the single engine's
    sentence: an exception escaping ``generate`` would cross Ray as its traceback."""
    import asyncio

    from minillm.serve.client import ACCEPTED, EngineFailure
    from minillm.serve.replicas import EngineReplica, Refusal

    class Stream:
        def __aiter__(self):
            return self

        async def __anext__(self):
            raise EngineFailure("internal error in the engine: ValueError: token 0 breaks the constraint")

        def close(self):
            pass

    class Engine:
        def stop(self):  # EngineReplica.__del__ stops its engine
            pass

        async def submit(self, *args):
            if where == "submit":
                raise EngineFailure("internal error in the engine: KeyError: 'x'")
            return Stream()

    replica = EngineReplica.__new__(EngineReplica)  # no model: only generate's error paths are under test
    replica.engine = Engine()

    async def items():
        return [item async for item in replica.generate([1, 2], None, "r")]

    got = asyncio.run(items())  # before: EngineFailure raised out of generate (Ray's traceback at the front)
    assert got[-1] == Refusal(500, "internal error in the engine: " + (
        "KeyError: 'x'" if where == "submit" else "ValueError: token 0 breaks the constraint"))
    assert got[:-1] == ([] if where == "submit" else [ACCEPTED])


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    from minillm.serve.replicas import start_ray

    start_ray(num_cpus=1)
    yield ray
    ray.shutdown()


def ray_listening() -> list[tuple[str, int, str]]:
    """(address, port, process) of every TCP socket listening in this process and its children (Ray's)."""
    import psutil

    me = psutil.Process()
    processes = {p.pid: p for p in [me, *me.children(recursive=True)]}
    listening = []
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.pid in processes:
            listening.append((c.laddr.ip, c.laddr.port, " ".join(processes[c.pid].cmdline())[:80]))
    return listening


@pytest.mark.slow
def test_rays_dashboard_is_off_unless_asked_for(ray_cluster):
    listening = ray_listening()
    assert listening, "no Ray process found listening"
    # the dashboard's head process still runs headless (Ray's API server); its web UI on 8265 does not
    assert not [entry for entry in listening if entry[1] == 8265], listening
    with pytest.raises(httpx.ConnectError):
        httpx.get("http://127.0.0.1:8265/", timeout=5)


@pytest.mark.slow
def test_ray_listens_on_loopback_only(ray_cluster):
    from minillm.serve.request_guard import is_loopback

    exposed = [entry for entry in ray_listening() if not is_loopback(entry[0])]
    assert not exposed, exposed


# -----------------------------------------------------------------------------------------------
# 7. Drain: at the deadline, each stream still running ends with an error event and [DONE]


@pytest.mark.slow
def test_at_the_drain_deadline_each_stream_gets_an_error_event_and_done(smollm2_path):
    import threading
    import time

    with serve_process(smollm2_path, "--drain-timeout", "2", kv_cache_bytes=64 << 20) as (process, url):
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
        lines, started = [[], []], [threading.Event(), threading.Event()]

        def read(i: int) -> None:
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            lines[i].append(line[6:])
                            started[i].set()
            except httpx.HTTPError as e:  # before: the stream was cut mid-chunk
                lines[i].append(f"cut: {type(e).__name__}")

        readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
        for reader in readers:
            reader.start()
        assert all(event.wait(120) for event in started)
        process.send_signal(signal.SIGTERM)
        began = time.monotonic()
        for reader in readers:
            reader.join(60)
        assert process.wait(timeout=60) == 0
        assert time.monotonic() - began < 30  # the 2 s drain, not the 400 tokens
        log = process.stdout.read()
    for stream in lines:
        assert stream[-1] == "[DONE]", stream[-3:]
        error = json.loads(stream[-2])["error"]
        assert "shutting down" in error["message"] and error["type"] == "server_error", error
        assert all("choices" in json.loads(chunk) for chunk in stream[:-2])  # whole chunks before it
    assert "CancelledError" not in log and "Traceback" not in log, log
    assert "drain timeout (2.0 s)" in log


# -----------------------------------------------------------------------------------------------
# 10. The page's headers, and the Host check on every route


@pytest.mark.slow
def test_the_page_is_sent_with_a_csp_and_cannot_be_framed(server):
    from html.parser import HTMLParser

    page = httpx.get(server.url + "/")
    csp = [part.strip() for part in page.headers["content-security-policy"].split(";")]
    assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "unsafe-inline" not in page.headers["content-security-policy"]
    assert page.headers["x-frame-options"] == "DENY" and page.headers["x-content-type-options"] == "nosniff"

    class Inline(HTMLParser):  # under default-src 'self', inline code would not run: the page has none
        found, sources = [], []

        def handle_starttag(self, tag, attrs):
            attrs = dict(attrs)
            if tag == "style" or (tag == "script" and "src" not in attrs) or "style" in attrs or \
                    any(name.startswith("on") for name in attrs):
                self.found.append(tag)
            self.sources += [attrs[k] for k in ("src", "href") if tag in ("script", "link") and k in attrs]

    parser = Inline()
    parser.feed(page.text)
    assert parser.found == [] and sorted(parser.sources) == ["/static/chat.css", "/static/chat.js"]
    for source, media_type in (("/static/chat.js", "text/javascript"), ("/static/chat.css", "text/css")):
        response = httpx.get(server.url + source)
        assert response.status_code == 200 and response.headers["content-type"].startswith(media_type)
        assert response.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(server.url + "/static/../app.py").status_code == 404
    assert httpx.get(server.url + "/static/chat.html.bak").status_code == 404


ROUTES = [("GET", "/"), ("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"),
          ("POST", "/v1/completions")]


@pytest.mark.slow
@pytest.mark.parametrize("method, path", ROUTES)
def test_a_rebound_host_name_is_refused_on_every_route(server, model, method, path):
    body = {"json": {"model": model, "prompt": "Hi", "max_tokens": 1}} if method == "POST" else {}
    for host in ("evil.example", "evil.example:%d" % server.port, "127.0.0.1.evil.example", "localhost.evil"):
        response = httpx.request(method, server.url + path, headers={"Host": host}, timeout=60, **body)
        assert response.status_code == 403, (host, response.text)  # before: 200, readable after DNS rebinding
        error = response.json()["error"]
        assert error["param"] == "host" and host in error["message"] and "--allowed-hosts" in error["message"]
    for host in ("localhost", "localhost:%d" % server.port, "127.0.0.1:1", "[::1]:8000", "LOCALHOST"):
        assert httpx.request(method, server.url + path, headers={"Host": host}, timeout=60, **body).status_code \
            == 200, host


@pytest.mark.slow
def test_a_request_without_host_is_refused(server):
    import socket

    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400") and b"no Host header" in answer, answer[:200]


@pytest.mark.slow
def test_allowed_hosts_adds_names(llm, model):
    with BackgroundServer(llm_app(llm, ServerConfig(log_interval=60.0, allowed_hosts=["llm.internal"]))) as server:
        assert httpx.get(server.url + "/metrics", headers={"Host": "llm.internal:8080"}).status_code == 200
        assert httpx.get(server.url + "/metrics", headers={"Host": "localhost"}).status_code == 200
        assert httpx.get(server.url + "/metrics", headers={"Host": "evil.example"}).status_code == 403
    with BackgroundServer(llm_app(llm, ServerConfig(log_interval=60.0, allowed_hosts=["*"]))) as server:
        assert httpx.get(server.url + "/metrics", headers={"Host": "anything.example"}).status_code == 200
