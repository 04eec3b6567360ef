"""The server's wire pieces without a model: SSE events (parsed by the openai client's own SSE
decoder), stop strings over a stream, request validation and error bodies."""
import json
import random

import pytest
from openai._streaming import SSEDecoder

from minillm.serve.errors import APIError
from minillm.serve.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from minillm.serve.sse import SSE_DONE

PAYLOADS = [
    {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": []},
    {"choices": [{"index": 0, "delta": {"content": "line one\nline two\r\n\n"}, "finish_reason": None}]},
    {"text": "naïve café 语言 🙂", "nested": {"list": [1, 2.5, None, True], "empty": {}}},
    {"error": {"message": "bad \"quotes\" and \\ backslashes", "type": "x", "param": None, "code": None}},
    {"text": "data: [DONE]\n\ndata: not a second event"},
]


def decode_events(raw: str):
    """The openai client's SSE parser: what a real client makes of our bytes."""
    return list(SSEDecoder().iter_bytes([raw.encode("utf-8")]))


@pytest.mark.ch09_sse_event
@pytest.mark.parametrize("payload", PAYLOADS)
def test_an_sse_event_is_one_data_line_the_client_parses_back(impl, payload):
    event = impl("ch09_server").sse_event(payload)
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert "\n" not in event[:-2] and "\r" not in event, "the JSON must stay on one line"
    events = decode_events(event)
    assert len(events) == 1 and events[0].event is None
    assert json.loads(events[0].data) == payload


@pytest.mark.ch09_sse_event
def test_a_stream_of_events_then_done_decodes_in_order(impl):
    sse_event = impl("ch09_server").sse_event
    raw = "".join(sse_event(p) for p in PAYLOADS) + SSE_DONE
    events = decode_events(raw)
    assert [json.loads(e.data) for e in events[:-1]] == PAYLOADS
    assert events[-1].data == "[DONE]"


# -----------------------------------------------------------------------------------------------
# Stop strings over a stream of pieces (the server streams what the filter releases)


def safe_to_release(text: str, stops: list[str]) -> str:
    """The fact: up to the first stop string; without one, all but the longest tail that could
    still grow into a stop string."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if hits:
        return text[:min(hits)]
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[:len(text) - hold]


@pytest.mark.ch09_stop_stream
@pytest.mark.parametrize("seed", range(6))
def test_streamed_text_never_shows_a_stop_string_and_holds_back_no_more_than_needed(impl, seed):
    rng = random.Random(seed)
    alphabet = "ab <|>\n"
    text = "".join(rng.choice(alphabet) for _ in range(60))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(0, 20)))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    stop_filter = impl("ch09_server").StopStringFilter(stops)
    released, seen, expected, stopped = "", "", "", False
    for piece in pieces:
        seen += piece
        released += stop_filter.push(piece)
        if not stopped:  # the stream ends at the first stop string to appear; nothing after it counts
            stopped = any(s in seen for s in stops)
            expected = safe_to_release(seen, stops)
        assert released == expected, (pieces, stops)
    released += stop_filter.flush()
    assert released == (expected if stopped else text)
    assert stop_filter.stopped == stopped


# -----------------------------------------------------------------------------------------------
# Request validation: strict types, unknown fields refused, SamplingParams errors named


def error_of(body: dict | str, model=CompletionRequest) -> APIError:
    raw = body if isinstance(body, str) else json.dumps(body)
    with pytest.raises(APIError) as e:
        request = parse_request(raw.encode(), model)
        request.check_stream_options()
        request.to_sampling_params()
    return e.value


@pytest.mark.parametrize("body,param,words", [
    ("{not json", None, "not valid JSON"),
    ("[1, 2]", None, "JSON object"),
    ({"prompt": "hi"}, "model", "Missing required parameter"),
    ({"model": "m", "prompt": "hi", "max_tokens": "16"}, "max_tokens", "valid integer"),
    ({"model": "m", "prompt": "hi", "n": True}, "n", "valid integer"),
    ({"model": "m", "prompt": "hi", "logit_bias": {"1": 5}}, "logit_bias", "Unrecognized request argument"),
    ({"model": "m", "prompt": "hi", "temperature": -0.5}, "temperature", "temperature must be"),
    ({"model": "m", "prompt": "hi", "top_p": 0}, "top_p", "top_p must be"),
    ({"model": "m", "prompt": "hi", "top_k": -3}, "top_k", "top_k must be"),
    ({"model": "m", "prompt": "hi", "presence_penalty": 3}, "presence_penalty", "in [-2, 2]"),
    ({"model": "m", "prompt": "hi", "logprobs": 50}, "logprobs", "logprobs must be in [0, 20]"),
    ({"model": "m", "prompt": "hi", "min_tokens": 20}, "min_tokens", "<= max_tokens"),
    ({"model": "m", "prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
])
def test_bad_completion_requests_get_a_400_naming_the_parameter(body, param, words):
    e = error_of(body)
    assert e.status == 400 and e.param == param and words in e.message
    assert e.body() == {"error": {"message": e.message, "type": "invalid_request_error", "param": param,
                                  "code": None}}


def test_chat_names_its_own_fields():
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert error_of({**base, "top_logprobs": 2}, ChatCompletionRequest).param == "top_logprobs"
    assert error_of({**base, "logprobs": True, "top_logprobs": 99}, ChatCompletionRequest).param == "top_logprobs"
    robot = {**base, "messages": [{"role": "robot", "content": "x"}]}
    assert error_of(robot, ChatCompletionRequest).param == "messages"
    max_tokens = parse_request(json.dumps({**base, "max_completion_tokens": 0}).encode(), ChatCompletionRequest)
    with pytest.raises(APIError) as e:
        max_tokens.to_sampling_params()
    assert e.value.param == "max_completion_tokens"


def test_accepted_fields_reach_sampling_params():
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "temperature": 0.5, "top_p": 0.9, "seed": 7, "stop": "\n", "logprobs": True, "top_logprobs": 3,
            "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True, "min_tokens": 2,
            "stop_token_ids": [5], "presence_penalty": 0.5, "frequency_penalty": -0.5, "user": "someone",
            "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 10}
    request = parse_request(json.dumps(body).encode(), ChatCompletionRequest)
    p = request.to_sampling_params()
    assert (p.temperature, p.top_p, p.seed, p.stop, p.logprobs, p.top_k, p.min_p) == (0.5, 0.9, 7, ["\n"], 3, 5, 0.1)
    assert (p.repetition_penalty, p.ignore_eos, p.min_tokens, p.stop_token_ids, p.max_tokens) == (1.2, True, 2, [5], 10)
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -0.5)
    assert request.include_usage and request.messages[0].as_dict() == {"role": "user", "content": "hi"}


def test_openai_defaults_apply_when_fields_are_absent_or_null():
    p = parse_request(b'{"model": "m", "prompt": "hi", "temperature": null}', CompletionRequest).to_sampling_params()
    assert (p.n, p.temperature, p.top_p, p.max_tokens, p.logprobs, p.stop) == (1, 1.0, 1.0, 16, None, [])
