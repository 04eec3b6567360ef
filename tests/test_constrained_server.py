"""response_format and tools through minillm serve, with the official openai client.

Few requests, each as short as its check allows: the model is the real SmolLM2 and every request
is a generation, so the file keeps one request per behaviour."""
import json

import jsonschema
import openai
import pytest
from openai import OpenAI

from minillm.generation.constrained.examples import PERSON, WEATHER_CALL
from minillm.llm import LLM
from minillm.serve.app import BackgroundServer, llm_app

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                           "parameters": WEATHER_CALL}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a city", "parameters": {
             "type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 20}}}}}]
ASK = [{"role": "user", "content": "What's the weather in Paris for the next 3 days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(smollm2_path):
    with BackgroundServer(llm_app(LLM(smollm2_path))) as server:
        yield OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600), server.app.state.model_name


def test_json_schema_and_json_object(client):
    client, model = client
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Invent a person as JSON."}], temperature=0, max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    reply = client.chat.completions.create(  # a question whose JSON answer is short, so that it ends
        model=model, messages=[{"role": "user", "content": 'Reply with a JSON object with one key "answer": what is '
                                                            '2 + 2?'}],
        temperature=0, max_tokens=24, response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def check_call(call, tools=TOOLS) -> dict:
    """The call is in OpenAI's format and its arguments validate against its tool's parameters."""
    assert call.type == "function" and call.id.startswith("call_")
    tool = next(t for t in tools if t["function"]["name"] == call.function.name)
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def test_tool_calls_required_named_streamed_and_answered(client):
    client, model = client
    # "required": some call, to any of the tools
    reply = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=60)
    assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
    check_call(reply.choices[0].message.tool_calls[0])

    # a named function: that one, and the same call streamed as tool_calls deltas
    reply = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0,
                                           max_tokens=60)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    call = message.tool_calls[0]
    assert call.function.name == "get_weather"
    arguments = check_call(call)
    chunks = list(client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                                 temperature=0, max_tokens=60, stream=True))
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices]
    assert [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # the call and its result go back to the model (tool_choice "auto" by default), which answers
    follow = client.chat.completions.create(model=model, temperature=0, max_tokens=8, tools=TOOLS, messages=[
        *ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny", "max": 24}'}])
    assert follow.choices[0].message.content or follow.choices[0].message.tool_calls


def test_unsupported_schema_is_a_400_naming_it(client):
    client, model = client
    with pytest.raises(openai.BadRequestError, match="uniqueItems at \\$ is not supported") as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}})
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model=model, messages=ASK, max_tokens=5, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
