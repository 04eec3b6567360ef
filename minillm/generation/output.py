"""From sampled token ids to the text a caller sees, and the decision that a sequence is done.

Shared by the single-request loop (chapter 06) and the batching engine (chapter 08): each sequence
owns one ``OutputBuilder``. It streams text through the UTF-8-safe detokenizer and the stop-string
filter, and ends the sequence on eos, a stop token, a stop string, ``max_tokens`` or a full context.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from minillm.generation.sampling import SamplingParams, TokenLogprobs
from minillm.generation.stop import StopStringFilter
from minillm.generation.tokenizer import StreamDetokenizer, Tokenizer

FINISH_STOP = "stop"      # eos, a stop token id or a stop string
FINISH_LENGTH = "length"  # max_tokens reached, or the context is full


@dataclass
class CompletionOutput:
    """One generated sequence (vLLM's names). ``token_ids`` include a final eos/stop token."""
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[TokenLogprobs] | None = None


class OutputBuilder:
    """Appends sampled tokens to one sequence; ``append`` returns the text now safe to stream."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt_len: int,
                 context_length: int, index: int = 0):
        self.params = params
        self.room = context_length - prompt_len  # tokens that still fit in the context
        self.eos_id = tokenizer.eos_id
        self.detokenizer = StreamDetokenizer(tokenizer, skip_special_tokens=True)
        self.stop_filter = StopStringFilter(params.stop)
        self.output = CompletionOutput(index=index, logprobs=[] if params.logprobs is not None else None)

    @property
    def finished(self) -> bool:
        return self.output.finish_reason is not None

    def append(self, token_id: int, logprobs: TokenLogprobs | None = None) -> str:
        out, p = self.output, self.params
        if self.finished:
            raise RuntimeError(f"sequence {out.index} already finished ({out.finish_reason})")
        out.token_ids.append(token_id)
        if out.logprobs is not None:
            out.logprobs.append(logprobs)
        # Before min_tokens nothing may end the sequence, stop strings included (vLLM's rule).
        text = self.detokenizer.push(token_id)
        piece = text if len(out.token_ids) <= p.min_tokens else self.stop_filter.push(text)
        if not self.stop_filter.stopped and (reason := self._end_by_token(token_id)) is not None:
            piece += self.stop_filter.push(self.detokenizer.flush()) + self.stop_filter.flush()
            out.finish_reason, out.stop_reason = reason
        if self.stop_filter.stopped:  # a stop string, possibly revealed by the final flush
            out.finish_reason, out.stop_reason = FINISH_STOP, self.stop_filter.matched
        out.text += piece
        return piece

    def _end_by_token(self, token_id: int) -> tuple[str, str | int | None] | None:
        out, p = self.output, self.params
        n = len(out.token_ids)
        if n >= p.min_tokens:
            if token_id in p.stop_token_ids:
                return FINISH_STOP, token_id
            if not p.ignore_eos and token_id == self.eos_id:
                return FINISH_STOP, None
        if (p.max_tokens is not None and n >= p.max_tokens) or n >= self.room:
            return FINISH_LENGTH, None
        return None
