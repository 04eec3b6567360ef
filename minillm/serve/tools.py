"""Tool calls for chat templates that know no tools (SmolLM2's writes only role and content).

OpenAI's ``tools`` reach the model as text in the system message, in the Hermes layout that small
open models are trained on, and a call comes back as one JSON object between tags:

    <tool_call>{"name": "get_weather", "arguments": {"location": "Paris"}}</tool_call>

``tool_choice`` becomes a constraint on the output (chapter 11's regex over the JSON Schema of
every tool's parameters), so a call always names a real tool with valid arguments:

    "none"                no constraint, tools not offered
    "auto" (the default)  either a call, or any text that does not start with "<"
    "required"            exactly one call, to any of the tools
    {"type": "function", "function": {"name": ...}}   exactly one call, to that tool

Earlier turns go back to the template the same way: an assistant's ``tool_calls`` as those tags,
a ``tool`` message's content as it is (the template writes its role).
"""
from __future__ import annotations

import json
import re
import uuid

from minillm.generation.constrained.json_schema import schema_to_regex
from minillm.generation.constrained.regex import escape

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(re.escape(OPEN) + r"(.*)" + re.escape(CLOSE), re.DOTALL)
# the start of a call as call_regex writes it: the name whole, then whatever of the arguments came
CUT_CALL = re.compile(re.escape(OPEN) + r'\{"name": "((?:[^"\\]|\\.)*)", "arguments": (.*)', re.DOTALL)


def system_prompt(tools: list[dict]) -> str:
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return ("You may call functions. Their signatures are in <tools></tools>:\n<tools>\n" + listing +
            "\n</tools>\nTo call one, answer with\n" + OPEN + '{"name": <function name>, "arguments": <arguments '
            "object>}" + CLOSE)


def call_regex(tools: list[dict], choice: str | dict) -> str | None:
    """The constraint for `choice` over `tools` (None: unconstrained)."""
    if choice == "none":
        return None
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        tools = [t for t in tools if t["function"]["name"] == name]
        if not tools:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t["function"]["name"]},
                             "arguments": t["function"].get("parameters") or {"type": "object", "properties": {},
                                                                             "additionalProperties": False}}}
             for t in tools]
    call = escape(OPEN) + schema_to_regex({"anyOf": calls}) + escape(CLOSE)
    return call if choice != "auto" else rf"{call}|[^<][\s\S]*"


def parse_calls(text: str) -> list[dict] | None:
    """The tool calls in a completion, in OpenAI's wire format (None: the model answered in text)."""
    match = CALL.fullmatch(text.strip())
    if match is None:
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError:
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
        return None
    return [wire_call(call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False))]


def parse_cut_call(text: str) -> list[dict]:
    """A call that max_tokens or a stop string cut before its closing tag, as OpenAI and vLLM report
    one: the call so far with its partial ``arguments`` text (not valid JSON), and the finish reason
    that cut it ("length" or "stop", never "tool_calls"), so that a client sees the cut and does not
    run it; never the raw ``<tool_call>{...`` as content. Cut before its name was whole: no call."""
    match = CUT_CALL.match(text.strip())
    if match is None:
        return []
    name, arguments = json.loads(f'"{match.group(1)}"'), match.group(2)
    try:  # the arguments may be whole, only the closing brace or tag cut
        arguments = json.dumps(json.JSONDecoder().raw_decode(arguments)[0], ensure_ascii=False)
    except json.JSONDecodeError:
        pass
    return [wire_call(name, arguments)]


def wire_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


def template_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation as role + content messages: tools in the system message, calls as tags."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls"):
            content += "".join(OPEN + json.dumps({"name": c["function"]["name"],
                                                  "arguments": json.loads(c["function"]["arguments"] or "{}")},
                                                 ensure_ascii=False) + CLOSE for c in m["tool_calls"])
        out.append({"role": m["role"], "content": content})
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system_prompt(tools)}
        else:
            out.insert(0, {"role": "system", "content": system_prompt(tools)})
    return out
