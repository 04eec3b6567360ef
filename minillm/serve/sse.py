"""Server-sent events: how a streamed completion travels over one HTTP response.

The response has ``Content-Type: text/event-stream`` and stays open; the server writes one *event*
per piece of news. An event is one or more ``field: value`` lines ended by a blank line. OpenAI
uses a single ``data`` field holding one line of JSON, and ends the stream with a literal
``[DONE]``:

    data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[...]}\\n
    \\n
    data: [DONE]\\n
    \\n

The JSON must stay on one line: a newline inside the payload would end the ``data`` field early.
``json.dumps`` writes a newline in a string as the two characters ``\\n``, so generated text with
line breaks is safe.
"""
from __future__ import annotations

import json

SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: dict) -> str:
    """One ``data:`` event carrying ``payload`` as compact single-line JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"
