"""your_code's server run (from chapter 09): one streamed completion through the OpenAI server app,
in this process, on the model given (the learner's, with chapter 09's pieces seated), then one
/metrics read, checked by the definitions of the four latencies.

The server writes each SSE event through ``minillm.serve.routes.sse_event`` and times each finished
request through ``minillm.serve.metrics.request_latencies``: the seats of ch09_sse_event and
ch09_metric (seats.py), swapped like every other. The server's modules are imported only when the
run is made: ``import minillm.course`` stays as light as it was.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from minillm.llm import load_tokenizer
from minillm.model.transformer import Model
from minillm.runtime.engine import LLMEngine

SERVE_KV_CACHE_BYTES = 32 << 20  # one request at a time: a small cache is plenty
SERVED_NAME = "smollm2"


def serve_run(path: Path, model: Model, prompt: str, max_tokens: int) -> tuple[list, str]:
    """One streamed completion (greedy, ``ignore_eos``, with usage) and then one /metrics read, on
    the server app in this process serving ``model``: ([the streamed text, what /metrics says of
    the request], a summary). The text is None when the body does not parse as SSE."""
    from fastapi.testclient import TestClient

    from minillm.serve.app import create_app, local_client

    tokenizer = load_tokenizer(path)
    engine = LLMEngine(model, tokenizer, kv_cache_bytes=SERVE_KV_CACHE_BYTES)
    client = local_client(engine, SERVED_NAME)
    app = create_app(client, tokenizer, engine.limits, SERVED_NAME)
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with TestClient(app, base_url="http://127.0.0.1") as http:
        sent = time.perf_counter()
        raw = http.post("/v1/completions", json=body).content.decode("utf-8")
        wall = time.perf_counter() - sent
        _wait_until_forgotten(client)
        metrics = http.get("/metrics").text
    try:
        chunks = sse_chunks(raw)
    except ValueError as err:
        return [None, "no stream to time"], f"the body is not SSE: {err}"
    text = "".join(choice.get("text", "") for chunk in chunks for choice in chunk.get("choices") or [])
    usage = next((chunk["usage"] for chunk in chunks if chunk.get("usage")), None)
    if usage is None:
        return [text, "no usage chunk"], f"{len(chunks)} SSE events, none with the usage"
    latencies = latency_series(metrics)
    problems = metric_problems(latencies, usage["completion_tokens"], wall)
    verdict = "; ".join(problems) or "TTFT, ITL, TPOT and E2E agree with the stream"
    return [text, verdict], (f"{len(chunks)} SSE events, /metrics: TTFT {latencies.get('ttft_sum', 0) * 1e3:.0f} ms, "
                             f"TPOT {latencies.get('tpot_sum', 0) * 1e3:.0f} ms")


def _wait_until_forgotten(client, timeout: float = 60.0) -> None:
    """The engine thread hands a request's last chunk to its stream, then records its latencies and
    forgets it: /metrics describes the request once it is forgotten. The timeout guards a hang only."""
    deadline = time.monotonic() + timeout
    while client.streams:
        if time.monotonic() > deadline:
            raise RuntimeError("the server never finished the request")
        time.sleep(0.01)


def sse_data(raw: str) -> list[str]:
    """The ``data`` of each event of an SSE body, which must end with the event ``[DONE]``
    (the WHATWG rules: an event ends at a blank line; a line is ``field: value``, a line starting
    with a colon is a comment; an event's data lines join with newlines)."""
    events = raw.replace("\r\n", "\n").replace("\r", "\n").split("\n\n")
    if events[-1] != "":
        raise ValueError(f"the body does not end with a blank line: {raw[-60:]!r}")
    data = []
    for event in events[:-1]:
        lines = [line.partition(":") for line in event.split("\n") if not line.startswith(":")]
        values = [value[1:] if value.startswith(" ") else value for field, _, value in lines if field == "data"]
        if values:
            data.append("\n".join(values))
    if not data or data[-1] != "[DONE]":
        raise ValueError("the stream does not end with the event 'data: [DONE]'")
    return data[:-1]


def sse_chunks(raw: str) -> list[dict]:
    """The JSON chunk each event of an SSE body carries (``sse_data``)."""
    chunks = []
    for i, data in enumerate(sse_data(raw)):
        try:
            chunks.append(json.loads(data))
        except ValueError:
            raise ValueError(f"event {i}'s data is not one JSON document: {data[:60]!r}") from None
    return chunks


LATENCY_SERIES = {"ttft": "time_to_first_token_seconds", "itl": "inter_token_latency_seconds",
                  "tpot": "request_time_per_output_token_seconds", "e2e": "e2e_request_latency_seconds"}


def latency_series(metrics_text: str) -> dict[str, float]:
    """``ttft_count``, ``ttft_sum``, ... of the server's latency histograms, from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {s.name: s.value for family in text_string_to_metric_families(metrics_text) for s in family.samples}
    return {f"{short}_{part}": samples[f"minillm:{series}_{part}"]
            for short, series in LATENCY_SERIES.items() for part in ("count", "sum")
            if f"minillm:{series}_{part}" in samples}


def metric_problems(m: dict[str, float], output_tokens: int, wall: float) -> list[str]:
    """What /metrics' latencies of one request of ``output_tokens`` tokens, which the client saw
    take ``wall`` seconds, get wrong - by the definitions: one TTFT, E2E and TPOT each, a gap per
    token after the first; 0 < TTFT <= E2E <= wall; the gaps add up to E2E - TTFT, which TPOT
    spreads over the tokens after the first."""
    expected = {"ttft_count": 1, "e2e_count": 1, "itl_count": output_tokens - 1, "tpot_count": int(output_tokens > 1)}
    problems = [f"{name[:-6].upper()} observed {m.get(name, 0):g} times, not {n}"
                for name, n in expected.items() if m.get(name, 0) != n]
    if problems:
        return problems
    ttft, e2e, itl = m["ttft_sum"], m["e2e_sum"], m["itl_sum"]
    close = lambda a, b: abs(a - b) <= 1e-9 + 1e-6 * abs(b)  # noqa: E731  (sums of floats, printed in full)
    if not 0 < ttft <= e2e <= wall:
        problems.append(f"not 0 < TTFT ({ttft:.4g} s) <= E2E ({e2e:.4g} s) <= the client's wait ({wall:.4g} s)")
    if not close(itl, e2e - ttft):
        problems.append(f"the ITL gaps add up to {itl:.4g} s, not E2E - TTFT = {e2e - ttft:.4g} s")
    if output_tokens > 1 and not close(m["tpot_sum"], (e2e - ttft) / (output_tokens - 1)):
        problems.append(f"TPOT is {m['tpot_sum']:.4g} s, not (E2E - TTFT) / {output_tokens - 1} = "
                        f"{(e2e - ttft) / (output_tokens - 1):.4g} s")
    return problems
