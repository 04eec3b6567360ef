"""The one way the engine refuses a request: ``RequestRejected``, raised by ``LLMEngine.add_request``.

Every check of a request against the engine's limits (the vocabulary, ``n`` against
``max_num_seqs``, the prompt and its completion against the longest sequence the context and the
KV cache hold) lives in the engine, so that ``LLM.generate``, ``LLM.stream`` and the server refuse
the same requests with the same words. The rejection names the request field at fault (``param``)
and, where OpenAI defines one, its error ``code``: the server answers it with a 400 carrying both.
"""
from __future__ import annotations

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code for a prompt + completion that do not fit


class RequestRejected(ValueError):
    """A request the engine will not run; ``param`` is the field at fault, ``code`` OpenAI's error code."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
