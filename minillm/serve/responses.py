"""OpenAI's response bodies, built from the engine's tokens as they arrive.

One ``ResponseBuilder`` follows one request. Each new token goes through ``add``, which returns the
stream chunk to send now (or ``None`` while the token brought no text yet - the detokenizer or the
stop-string filter is holding it back) and also keeps the whole completion, so the same object
answers a non-streamed request with ``response()`` at the end.

    chat stream:   role chunk per choice -> content chunks -> one chunk per choice with its
                   finish_reason -> (usage chunk with choices: [] if include_usage) -> [DONE]
    completions:   text chunks -> finish_reason chunks -> (usage chunk) -> [DONE]
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from itertools import accumulate

from minillm.generation.sampling import TokenLogprobs
from minillm.generation.tokenizer import Tokenizer
from minillm.runtime.engine import StepOutput
from minillm.serve import tools


@dataclass
class Choice:
    index: int
    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    unsent: list[TokenLogprobs] = field(default_factory=list)  # logprobs of tokens not streamed yet
    text_offset: int = 0  # completions: character offset of the next streamed token's logprob
    finish_reason: str | None = None


class ResponseBuilder:
    """Chunks and the final body of one request, for one endpoint (subclasses)."""
    object_name = chunk_object_name = id_prefix = ""

    def __init__(self, model: str, tokenizer: Tokenizer, n: int, prompt_tokens: int, logprobs: bool,
                 include_usage: bool):
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"  # also the engine's request id
        self.model, self.tokenizer = model, tokenizer
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.want_logprobs, self.include_usage = logprobs, include_usage
        self.choices = [Choice(i) for i in range(n)]

    def add(self, step: StepOutput) -> dict | None:
        """Record one token; return the chunk to stream, or None if it brought no text yet."""
        c = self.choices[step.index]
        c.text += step.text_delta
        c.num_tokens += 1
        c.finish_reason = step.finish_reason
        if step.logprobs is not None:
            c.logprobs.append(step.logprobs)
            c.unsent.append(step.logprobs)
        if not step.text_delta and step.finish_reason is None:
            return None
        choice = self.chunk_choice(c, step.text_delta, c.unsent)
        c.unsent = []
        return self.chunk([choice])

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    @property
    def usage(self) -> dict:
        completion = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def chunk(self, choices: list[dict]) -> dict:
        body = {"id": self.id, "object": self.chunk_object_name, "created": self.created, "model": self.model,
                "choices": choices}
        if self.include_usage:
            body["usage"] = None  # OpenAI's chunks say so explicitly until the usage chunk
        return body

    def start_chunks(self) -> list[dict]:
        return []

    def usage_chunk(self) -> dict:
        return {**self.chunk([]), "usage": self.usage}

    def response(self) -> dict:
        """The whole non-streamed body."""
        return {"id": self.id, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": [self.response_choice(c) for c in self.choices], "usage": self.usage}

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")

    # each endpoint's own layout
    def chunk_choice(self, c: Choice, text: str, entries: list[TokenLogprobs]) -> dict: ...
    def response_choice(self, c: Choice) -> dict: ...


class ChatResponseBuilder(ResponseBuilder):
    object_name, chunk_object_name, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"
    parse_tool_calls = False   # tools were offered: a reply that starts with "<" is a call

    def start_chunks(self) -> list[dict]:
        """The first delta of every choice names the speaker."""
        return [self.chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]) for c in self.choices]

    def calling(self, c: Choice) -> bool:
        """The reply is a tool call: with tools offered, the constraint lets a reply start with "<"
        only as a call (``tools.call_regex``)."""
        return self.parse_tool_calls and c.text.startswith("<")

    def finished_calls(self, c: Choice) -> tuple[list[dict], str]:
        """The calls of a finished reply that is a call, and its finish reason: "tool_calls" for a
        whole call, else the reason that cut it (``tools.parse_cut_call``)."""
        if (calls := tools.parse_calls(c.text)) is not None:
            return calls, "tool_calls"
        return tools.parse_cut_call(c.text), c.finish_reason

    def chunk_choice(self, c: Choice, text: str, entries: list[TokenLogprobs]) -> dict:
        if self.calling(c):   # a call is held back and sent whole
            if c.finish_reason is None:
                return {"index": c.index, "delta": {}, "logprobs": None, "finish_reason": None}
            calls, finish_reason = self.finished_calls(c)
            delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]} if calls else {}
            return {"index": c.index, "delta": delta, "logprobs": self.logprobs(c.logprobs),
                    "finish_reason": finish_reason}
        return {"index": c.index, "delta": {"content": text} if text else {}, "logprobs": self.logprobs(entries),
                "finish_reason": c.finish_reason}

    def response_choice(self, c: Choice) -> dict:
        if self.calling(c):
            calls, finish_reason = self.finished_calls(c)
            message = {"role": "assistant", "content": None, **({"tool_calls": calls} if calls else {})}
            return {"index": c.index, "message": message, "logprobs": self.logprobs(c.logprobs),
                    "finish_reason": finish_reason}
        return {"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": self.logprobs(c.logprobs), "finish_reason": c.finish_reason}

    def logprobs(self, entries: list[TokenLogprobs]) -> dict | None:
        if not self.want_logprobs:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            return {"token": self.token_text(token_id), "logprob": logprob,
                    "bytes": list(self.tokenizer.token_bytes(token_id))}

        return {"content": [{**entry(e.token_id, e.logprob),
                             "top_logprobs": [entry(t, lp) for t, lp in zip(e.top_ids, e.top_logprobs)]}
                            for e in entries]}


class CompletionResponseBuilder(ResponseBuilder):
    object_name, chunk_object_name, id_prefix = "text_completion", "text_completion", "cmpl-"

    def chunk_choice(self, c: Choice, text: str, entries: list[TokenLogprobs]) -> dict:
        logprobs = self.logprobs(entries, c.text_offset)
        c.text_offset += sum(len(self.token_text(e.token_id)) for e in entries)  # the next chunk goes on from here
        return {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}

    def response_choice(self, c: Choice) -> dict:
        return {"index": c.index, "text": c.text, "logprobs": self.logprobs(c.logprobs, 0),
                "finish_reason": c.finish_reason}

    def logprobs(self, entries: list[TokenLogprobs], first_offset: int) -> dict | None:
        """The legacy layout: parallel lists, alternatives as {token text: logprob} maps, and each
        token's character offset in the completion text."""
        if not self.want_logprobs:
            return None
        tokens = [self.token_text(e.token_id) for e in entries]
        offsets = list(accumulate(map(len, tokens), initial=first_offset))[:-1]
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.token_text(t): lp for t, lp in zip(e.top_ids, e.top_logprobs)}
                                 for e in entries],
                "text_offset": offsets}
