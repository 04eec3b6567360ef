"""Chapter 09 exercises: the pieces of a serving stack you write yourself.

Each stub has exactly the signature of the package's version (see REFERENCE; read it after you
have tried). Grade your work with

    .venv/bin/python -m pytest tests/test_serve_format.py tests/test_loadgen.py \\
        -m "ch09_sse_event or ch09_metric or ch09_stop_stream" --impl=exercises

Task 1 (ch09_sse_event)    sse_event: one server-sent event carrying a JSON chunk
Task 2 (ch09_stop_stream)  StopStringFilter: stream text without ever showing a stop string
Task 3 (ch09_metric)       request_latencies: TTFT, ITL, TPOT and E2E from a stream's timestamps
"""
from __future__ import annotations

from collections.abc import Sequence

from minillm.serve.loadgen import Latencies  # noqa: F401  (request_latencies returns one)

REFERENCE = {
    "sse_event": "minillm.serve.sse.sse_event",
    "request_latencies": "minillm.serve.loadgen.request_latencies",
    "StopStringFilter": "minillm.generation.stop.StopStringFilter",
}

# The functions each task (pytest marker) grades: course.check(marker) runs its tests.
TASKS = {
    "ch09_sse_event": ["sse_event"],
    "ch09_metric": ["request_latencies"],
    "ch09_stop_stream": ["StopStringFilter"],
}


# -----------------------------------------------------------------------------
# Task 1: the SSE event formatter

def sse_event(payload: dict) -> str:
    """One server-sent event whose ``data`` field is ``payload`` as JSON.

    A streamed OpenAI response is a long-lived HTTP response with ``Content-Type:
    text/event-stream``. Each event is a line ``data: <JSON>`` followed by a blank line:

        data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[...]}\\n\\n

    Rules that matter:
      - the JSON must be on ONE line: a line break inside would end the data field early, and the
        client would read half a JSON document (``json.dumps`` without ``indent`` writes a newline
        inside a string as the two characters backslash and n, so that is safe);
      - the event ends with two newlines (the blank line is what dispatches it);
      - the client parses ``data`` with ``json.loads``, so non-ASCII text may stay as it is
        (``ensure_ascii=False``) - either way it must parse back to ``payload``.

    The stream itself ends with the literal event ``data: [DONE]\\n\\n`` (the package's SSE_DONE).
    """
    raise NotImplementedError("chapter 9, task 1")


# -----------------------------------------------------------------------------
# Task 3: latency metrics from a stream's timestamps

def request_latencies(sent: float, content_times: list[float], done: float, output_tokens: int) -> Latencies:
    """TTFT, ITL, TPOT and E2E of one streamed request, in seconds (vLLM's definitions).

    Inputs (all ``time.perf_counter()`` readings except the count):
      sent            when the request left the client
      content_times   when each chunk carrying text arrived, in order
      done            when ``data: [DONE]`` arrived
      output_tokens   the number of generated tokens (from the usage chunk)

    Return ``Latencies(ttft, itl, tpot, e2e)``:
      ttft  time to first token: the first content chunk minus ``sent``
      itl   inter-token latencies: the gaps between consecutive content chunks (a list, one
            shorter than ``content_times``)
      tpot  time per output token after the first: (e2e - ttft) / (output_tokens - 1);
            None when output_tokens <= 1 (nothing to average)
      e2e   end-to-end latency: ``done`` minus ``sent``

    With no content chunk at all there is no first token: raise ValueError.
    Why TPOT and ITL differ: a server may pack several tokens into one chunk, so ITL sees one long
    gap where TPOT spreads the time over the tokens.
    """
    raise NotImplementedError("chapter 9, task 3")


# -----------------------------------------------------------------------------
# Task 2: a stop-string-aware stream

class StopStringFilter:
    """Holds back the tail of the streamed text that might still grow into a stop string.

    A client asks for ``stop=["\\nUser:"]``: the text must end just before the first stop string,
    and the stop string itself must never reach the client. But the model emits the text in
    pieces (one token's worth each), and a stop string can span pieces ("\\nUs" + "er:"). So:

      __init__(stops)    remember the stop strings (empty strings: ValueError); start with an
                         empty ``pending`` buffer and ``matched = None``.
      push(piece) -> str add ``piece`` to ``pending``. If any stop string now occurs in it, cut at
                         the earliest occurrence: return the text before it, set ``matched`` to
                         that stop string, and return "" for every later push. Otherwise return
                         everything except the longest tail of ``pending`` that is the beginning
                         (a proper prefix) of some stop string - that tail stays in ``pending``.
      flush() -> str     the stream ended without a stop string: the held-back tail is ordinary
                         text; return it (or "" once stopped).
      stopped            (property) whether a stop string was found.

    Example with stops ["<|end|>"]: push("Hello <|") -> "Hello " (keeps "<|"), push("en") -> "",
    push("d|> more") -> "" and stopped is True.
    """

    def __init__(self, stops: Sequence[str] = ()):
        raise NotImplementedError("chapter 9, task 2")

    @property
    def stopped(self) -> bool:
        raise NotImplementedError("chapter 9, task 2")

    def push(self, piece: str) -> str:
        raise NotImplementedError("chapter 9, task 2")

    def flush(self) -> str:
        raise NotImplementedError("chapter 9, task 2")
