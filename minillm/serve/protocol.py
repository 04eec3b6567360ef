"""The OpenAI request bodies as pydantic models, and their translation to ``SamplingParams``.

Parsing is strict, as OpenAI's own API is: ``"max_tokens": "16"`` or ``"n": true`` is a wrong
type, not something to coerce, and a field we do not know is refused rather than ignored (a
client that sends ``logit_bias`` must learn it had no effect). The one standard field accepted and
ignored is ``user`` (an end-user id OpenAI keeps for abuse monitoring; it changes no output).

Beyond OpenAI's fields, vLLM's extra sampling fields are accepted (the ``openai`` client sends them
with ``extra_body``): ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``,
``stop_token_ids``. Their ranges are checked by ``SamplingParams`` itself; a ``ValueError`` there
becomes a 400 naming the parameter.

What depends on the engine - token ids in the vocabulary, ``n`` against ``max_num_seqs``, the prompt
and its completion against the context and the KV cache - is checked by the engine alone; its
``RequestRejected`` comes back here to be named with this request's own field (``rejection``).
"""
from __future__ import annotations

import re
from dataclasses import fields
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from minillm.generation.sampling import SamplingParams
from minillm.runtime.errors import RequestRejected
from minillm.serve import tools as tool_format
from minillm.serve.errors import APIError, bad_request

MAX_LOGPROBS = 20  # most alternatives returned per token (vLLM's default cap)
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names and message names


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str          # JSON text, as OpenAI sends it


class ToolCall(Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None   # None: an assistant turn that only called tools
    name: str | None = Field(default=None, pattern=NAME_PATTERN)  # the template ignores it
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def content_unless_calling_tools(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant message with tool_calls "
                             "may leave it out)")
        return self

    def as_dict(self) -> dict:
        content = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(p.text for p in self.content)
        message = {"role": self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return message


class FunctionDefinition(Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None   # a JSON Schema
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(Strict):
    name: str
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SamplingFields(Strict):
    """What both endpoints share. ``None`` stands for "the default", as in OpenAI's API."""
    model: str
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    guided_regex: str | None = None
    guided_json: dict | str | None = None
    guided_choice: list[str] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def constraint_fields(self) -> list[str]:
        """The fields of this request that constrain the reply, in the order they are named."""
        return [name for name in ("guided_regex", "guided_json", "guided_choice") if getattr(self, name) is not None]

    def check_one_constraint(self) -> None:
        """The engine follows one constraint per reply: two would be intersected (which it cannot do)
        or one silently dropped, so a request that sends two is refused, naming both."""
        given = self.constraint_fields()
        if len(given) > 1:
            raise bad_request(f"{given[0]} and {given[1]} both constrain the reply, and a request may send only "
                              f"one constraint; send one of them", given[1])

    def check_model(self, served_model: str) -> None:
        if self.model != served_model:
            raise APIError(404, f"The model `{self.model}` does not exist. This server serves `{served_model}`.",
                           "model", "model_not_found")

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    def request_field(self, name: str | None) -> str | None:
        """This request's name for a ``SamplingParams`` field or an engine parameter."""
        return name

    def rejection(self, e: RequestRejected) -> APIError:
        """The engine's refusal as a 400 naming this request's field."""
        return bad_request(e.message, self.request_field(e.param), e.code)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, **constraint) -> SamplingParams:
        """SamplingParams with OpenAI's defaults; a bad value -> 400 naming the request field."""
        given = {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}
        given = {"max_tokens": max_tokens, "logprobs": logprobs, **given, **constraint}
        try:
            return SamplingParams(**given)
        except ValueError as e:
            name = str(e).split(" ", 1)[0]  # SamplingParams' messages start with the field name
            raise bad_request(str(e), self.request_field(name)) from None


SAMPLING_FIELDS = [f.name for f in fields(SamplingParams)
                   if f.name in SamplingFields.model_fields and f.name not in ("max_tokens", "logprobs")]


class CompletionRequest(SamplingFields):
    """POST /v1/completions. ``prompt`` is text or token ids (one prompt per request)."""
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request(f"prompt holds {len(prompt)} prompts; send one prompt per request", "prompt")
            prompt = prompt[0]
        return prompt  # an empty one is the engine's to refuse, as from any other caller

    def to_sampling_params(self) -> SamplingParams:
        check_logprobs(self.logprobs, "logprobs")
        self.check_one_constraint()
        return self.sampling_params(self.max_tokens, self.logprobs)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions. ``max_completion_tokens`` is the newer name of ``max_tokens``."""
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    def conversation(self) -> list[dict]:
        if not self.messages:
            raise bad_request("messages must be a non-empty list", "messages")
        try:
            return tool_format.template_messages([m.as_dict() for m in self.messages], self.offered_tools())
        except ValueError as e:   # a tool call whose arguments are not JSON
            raise bad_request(f"messages: a tool call's arguments are not valid JSON: {e}", "messages") from None

    def offered_tools(self) -> list[dict] | None:
        """The tools the model is told about (none when tool_choice is "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def parses_tool_calls(self) -> bool:
        return self.offered_tools() is not None

    def constraint_fields(self) -> list[str]:
        """Offered tools constrain the reply too (``tools.py``), even with tool_choice "auto": its
        regex allows either a call or text, so it cannot be combined with a second constraint."""
        fields_ = ["tools"] if self.parses_tool_calls else []
        if self.response_format is not None and self.response_format.type != "text":
            fields_.append("response_format")
        return fields_ + super().constraint_fields()

    def check_tools(self) -> None:
        """OpenAI's rules for function definitions, each refusal naming the offending field: a name of
        1 to 64 letters, digits, ``_`` or ``-`` (it is written into the prompt and into the call's tags,
        so ``</tool_call>`` or ``;`` in it would forge the format), names unique (a call names its
        tool), ``parameters`` an object schema (a call's arguments are a JSON object)."""
        seen: dict[str, int] = {}
        for i, tool in enumerate(self.tools or []):
            function, where = tool.function, f"tools[{i}].function"
            if not re.fullmatch(NAME_PATTERN, function.name):
                raise bad_request(f"Invalid '{where}.name': {function.name[:80]!r} does not match the pattern "
                                  f"'{NAME_PATTERN}' (1 to 64 letters, digits, underscores or dashes)",
                                  f"{where}.name", "invalid_value")
            if function.name in seen:
                raise bad_request(f"Invalid '{where}.name': {function.name!r} is also the name of "
                                  f"tools[{seen[function.name]}]; function names must be unique",
                                  f"{where}.name", "invalid_value")
            seen[function.name] = i
            # {} is taken as absent (a function without arguments), as tools.call_regex reads it
            if function.parameters and function.parameters.get("type") != "object":
                raise bad_request(f"Invalid '{where}.parameters': a function's parameters must be a JSON Schema "
                                  f"of type \"object\", got type {function.parameters.get('type')!r}",
                                  f"{where}.parameters", "invalid_function_parameters")

    def constraint(self) -> dict:
        """response_format and tools as SamplingParams' guided_* fields (at most one of them:
        ``check_one_constraint``)."""
        if self.tool_choice is not None and not self.tools:
            raise bad_request("tool_choice needs tools", "tool_choice")
        self.check_tools()
        fmt = self.response_format
        if self.parses_tool_calls:
            choice = self.tool_choice or "auto"
            try:
                pattern = tool_format.call_regex(self.offered_tools(), choice if isinstance(choice, str)
                                                 else choice.model_dump())
            except ValueError as e:  # a schema outside the subset, or an unknown tool name
                raise bad_request(f"tools: {e}", "tool_choice" if "tool_choice" in str(e) else "tools") from None
            return {"guided_regex": pattern}
        if fmt is None or fmt.type == "text":
            return {}
        if fmt.type == "json_object":
            return {"guided_json_object": True}
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema", "response_format")
        return {"guided_json": fmt.json_schema.schema_}

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The completion budget the client asked for (None: up to the context) and its field name.
        Two names for one limit: a request that gives both must give the same value."""
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise bad_request(f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                                  f"({self.max_completion_tokens}) are two names for the same limit and differ; "
                                  f"send one of them", "max_tokens")
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def request_field(self, name: str | None) -> str | None:
        renamed = {"prompt": "messages", "logprobs": "top_logprobs", "max_tokens": self.requested_max_tokens()[1],
                   "guided_json": "response_format", "guided_json_object": "response_format"}
        if self.parses_tool_calls:
            renamed["guided_regex"] = "tools"
        return renamed.get(name, name)

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        check_logprobs(self.top_logprobs, "top_logprobs")
        self.check_one_constraint()
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(self.requested_max_tokens()[0], logprobs, **self.constraint())


def check_logprobs(value: int | None, param: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"{param} must be in [0, {MAX_LOGPROBS}], got {value}", param)


def parse_request(body: bytes, model: type[Strict]) -> Strict:
    """Validate a raw JSON body; any problem -> a 400 naming the first offending field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None


def validation_error(e: ValidationError) -> APIError:
    first = e.errors(include_url=False)[0]
    loc = [str(part) for part in first["loc"]]
    if first["type"] == "json_invalid":
        return bad_request(f"the body is not valid JSON: {first['msg']}")
    if not loc:
        return bad_request(f"the body must be a JSON object: {first['msg']}")
    if first["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {'.'.join(loc)}", loc[0])
    if first["type"] == "missing":
        return bad_request(f"Missing required parameter: '{'.'.join(loc)}'", loc[0])
    return bad_request(f"Invalid value for '{'.'.join(loc)}': {first['msg']}", loc[0])
