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
from minillm.serve.app import BackgroundServer, create_app
from serve_process import serve_process

CHAT = [{"role": "user", "content": "What's the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_CALL}}
REQUIRED = {"tools": [WEATHER], "tool_choice": "required"}


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path, max_num_seqs=4, kv_cache_bytes=32 << 20, max_n=2)


@pytest.fixture(scope="module")
def server(llm):
    with BackgroundServer(create_app(llm, log_interval=60.0)) as server:
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
