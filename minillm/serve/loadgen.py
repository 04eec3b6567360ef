"""A load generator for any OpenAI-compatible server, measuring what users feel (vLLM's protocol).

Each request streams ``POST /v1/completions`` at temperature 0 with ``ignore_eos``, so every
request produces exactly ``output_len`` tokens whatever the text. From the stream's timestamps:

    TTFT   time to first token: request sent -> first chunk with text
    ITL    inter-token latency: the gaps between consecutive chunks with text
    TPOT   time per output token: (E2E - TTFT) / (output tokens - 1), one figure per request
    E2E    end-to-end latency: request sent -> ``data: [DONE]``

Token counts come from the usage chunk (``stream_options.include_usage``), not from counting
chunks (a chunk may carry several tokens, or none). Requests arrive all at once
(``request_rate=inf``) or as a Poisson process of the given rate (seeded), optionally under a cap
on how many are in flight. The report: request, output-token and total-token throughput;
*goodput* (vLLM's meaning: the requests that met every latency target given - TTFT, TPOT, E2E -
per second of the run, and here also as a fraction of all requests sent); mean, median and p99
of each latency.

    minillm bench serve --base-url http://127.0.0.1:8000 --num-prompts 64 --input-len 128 \\
        --output-len 64 --max-concurrency 16 --goodput ttft:2000 tpot:200

Prompts are random tokens of the model's tokenizer, decoded to text and re-encoded until the
text is exactly ``input_len`` tokens long (``--token-ids`` sends the ids themselves instead);
``--prefix-len`` gives every prompt the same random prefix (a prefix-caching workload).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
from tqdm.std import tqdm  # plain text: a command-line tool, not a notebook widget

from minillm.generation.tokenizer import Tokenizer

# -----------------------------------------------------------------------------------------------
# One request's latencies


@dataclass
class Latencies:
    """Seconds. ``tpot`` is None for a single output token (no gaps to average)."""
    ttft: float
    itl: list[float]
    tpot: float | None
    e2e: float


def request_latencies(sent: float, content_times: list[float], done: float, output_tokens: int) -> Latencies:
    """TTFT, ITL, TPOT and E2E of one streamed request, from its timestamps (perf_counter seconds).

    ``content_times`` are the arrival times of the chunks that carried text; ``done`` is when
    ``[DONE]`` arrived; ``output_tokens`` comes from the usage chunk.
    """
    if not content_times:
        raise ValueError("the stream carried no text: there is no first token to time")
    ttft = content_times[0] - sent
    e2e = done - sent
    itl = [later - earlier for earlier, later in zip(content_times, content_times[1:])]
    tpot = (e2e - ttft) / (output_tokens - 1) if output_tokens > 1 else None
    return Latencies(ttft, itl, tpot, e2e)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), interpolating linearly between order statistics (NumPy's default).

    Sorted values v[0..n-1] sit at ranks 0..n-1; the percentile sits at rank r = q/100 * (n-1),
    between v[floor(r)] and v[ceil(r)].
    """
    if not values:
        raise ValueError("no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    v = sorted(values)
    rank = q / 100 * (len(v) - 1)
    below = math.floor(rank)
    above = min(below + 1, len(v) - 1)
    return v[below] + (v[above] - v[below]) * (rank - below)


# -----------------------------------------------------------------------------------------------
# The workload


def sampleable_ids(tokenizer: Tokenizer) -> np.ndarray:
    """Ordinary tokens: no control or added tokens, which would be matched as specials on re-encoding."""
    excluded = set(tokenizer.special_ids) | set(tokenizer.added_ids)
    return np.array([i for i in range(tokenizer.vocab_size) if i not in excluded])


def exact_length_text(tokenizer: Tokenizer, ids: list[int], rng: np.random.Generator, allowed: np.ndarray) -> str:
    """Text that encodes to exactly len(ids) tokens, starting from the decoded ids.

    Decoding random ids and encoding the text again rarely gives the same ids (BPE merges across
    token boundaries), so trim or extend the re-encoded ids and try again.
    """
    length = len(ids)
    for _ in range(20):
        text = tokenizer.decode(ids)
        again = tokenizer.encode(text)
        if len(again) == length:
            return text
        ids = again[:length] if len(again) > length else again + rng.choice(allowed, length - len(again)).tolist()
    raise RuntimeError(f"could not build a text of exactly {length} tokens")


def build_prompts(tokenizer: Tokenizer, num_prompts: int, input_len: int, prefix_len: int = 0, seed: int = 0,
                  token_ids: bool = False) -> list[str | list[int]]:
    """``num_prompts`` random prompts of ``prefix_len + input_len`` tokens; the prefix is shared."""
    rng = np.random.default_rng(seed)
    allowed = sampleable_ids(tokenizer)
    prefix = rng.choice(allowed, prefix_len).tolist()
    prompts = []
    for _ in range(num_prompts):
        ids = prefix + rng.choice(allowed, input_len).tolist()
        prompts.append(ids if token_ids else exact_length_text(tokenizer, ids, rng, allowed))
    return prompts


def send_times(num_prompts: int, request_rate: float, seed: int = 0) -> np.ndarray:
    """When each request leaves (seconds from the start): all at 0, or a Poisson process of that rate."""
    if math.isinf(request_rate):
        return np.zeros(num_prompts)
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    gaps = np.random.default_rng(seed).exponential(1 / request_rate, num_prompts)  # (N,)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])                           # (N,)


# -----------------------------------------------------------------------------------------------
# Sending


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    latencies: Latencies | None = None
    error: str = ""
    tokens_from_usage: bool = True  # False: no usage chunk came; text chunks and the workload were counted


async def send_request(client: httpx.AsyncClient, model: str, prompt: str | list[int], output_len: int,
                       prompt_tokens: int, extra_body: dict | None = None) -> RequestResult:
    """One streamed completion, timed. ``prompt_tokens`` (the workload's count) stands in for the
    usage chunk when a server sends none."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, **(extra_body or {})}
    content_times, usage = [], None
    sent = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return RequestResult(False, error=f"HTTP {response.status_code}: {(await response.aread()).decode()}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return RequestResult(False, error=json.dumps(chunk["error"]))
                if any(choice.get("text") for choice in chunk.get("choices") or []):
                    content_times.append(time.perf_counter())
                usage = chunk.get("usage") or usage
        done = time.perf_counter()
    except httpx.HTTPError as e:
        return RequestResult(False, error=f"{type(e).__name__}: {e}")
    if not content_times:
        return RequestResult(False, error="the stream carried no text")
    output_tokens = usage["completion_tokens"] if usage else len(content_times)
    return RequestResult(True, usage["prompt_tokens"] if usage else prompt_tokens, output_tokens,
                         request_latencies(sent, content_times, done, output_tokens), tokens_from_usage=bool(usage))


# -----------------------------------------------------------------------------------------------
# A run


@dataclass
class LoadConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None          # None: the first model of GET /v1/models
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 64
    prefix_len: int = 0
    request_rate: float = math.inf    # requests per second; inf sends them all at once
    max_concurrency: int | None = None
    seed: int = 0
    token_ids: bool = False           # send token ids instead of text
    goodput: dict[str, float] = field(default_factory=dict)  # targets in ms: ttft, tpot, e2el
    extra_body: dict = field(default_factory=dict)           # more fields for every request (a peer's names)
    progress: bool = True


@dataclass
class LoadReport:
    summary: dict                  # the figures, JSON-ready
    requests: list[RequestResult]  # one per prompt, in order (for distributions)

    def table(self) -> str:
        s = self.summary
        rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
                ("Benchmark duration (s)", s["duration_s"]), ("Total input tokens", s["total_input_tokens"]),
                ("Total generated tokens", s["total_output_tokens"]),
                ("Request throughput (req/s)", s["request_throughput"]),
                ("Output token throughput (tok/s)", s["output_throughput"]),
                ("Total token throughput (tok/s)", s["total_token_throughput"])]
        if "request_goodput" in s:
            rows += [("Request goodput (req/s)", s["request_goodput"]),
                     ("Requests meeting the targets (%)", 100 * s["goodput_fraction"])]
        for metric, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                              ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
            rows.append((f"---{title}---", None))
            rows += [(f"{stat.capitalize()} {metric.upper()} (ms)", s[f"{stat}_{metric}_ms"])
                     for stat in ("mean", "median", "p99")]
        lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]
        for name, value in rows:
            if value is None:
                lines.append("{s:{c}^60}".format(s=name.strip("-"), c="-"))
            elif isinstance(value, float):
                lines.append(f"{name:<44}{value:>16.2f}")
            else:
                lines.append(f"{name:<44}{'-' if value is None else value:>16}")
        return "\n".join(lines + ["=" * 60])


GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def check_targets(targets_ms: dict[str, float]) -> None:
    """Goodput targets name known latencies and give a number of milliseconds >= 0."""
    unknown = set(targets_ms) - set(GOODPUT_METRICS)
    if unknown:
        raise ValueError(f"unknown goodput targets {sorted(unknown)}; use {', '.join(GOODPUT_METRICS)}")
    negative = {name: ms for name, ms in targets_ms.items() if not ms >= 0}
    if negative:
        raise ValueError(f"goodput targets must be >= 0 ms, got {negative}")


def meets_targets(lat: Latencies, targets_ms: dict[str, float]) -> bool:
    """Whether one request met every target (ms). A single-token answer has no TPOT: it meets any
    TPOT target (vLLM counts its TPOT as 0)."""
    check_targets(targets_ms)
    measured = {"ttft": lat.ttft, "tpot": lat.tpot or 0.0, "e2el": lat.e2e}
    return all(1000 * measured[name] <= target for name, target in targets_ms.items())


def goodput_figures(results: list[RequestResult], duration: float, targets_ms: dict[str, float]) -> dict:
    """Requests that completed and met every target: per second of the run (vLLM's request goodput)
    and as a fraction of all requests sent (a failed request met no target)."""
    good = sum(r.ok and meets_targets(r.latencies, targets_ms) for r in results)
    return {"request_goodput": good / duration, "goodput_fraction": good / len(results),
            "goodput_targets_ms": dict(targets_ms)}


def summarize(results: list[RequestResult], duration: float, goodput: dict[str, float] | None = None) -> dict:
    """vLLM's figures: throughputs over the whole run; latency statistics (ms) over completed requests."""
    done = [r for r in results if r.ok]
    if not done:
        raise RuntimeError(f"every request failed; the first error: {results[0].error}")
    lat = {"ttft": [r.latencies.ttft for r in done],
           "tpot": [r.latencies.tpot for r in done if r.latencies.tpot is not None],
           "itl": [gap for r in done for gap in r.latencies.itl],
           "e2el": [r.latencies.e2e for r in done]}
    total_in, total_out = sum(r.prompt_tokens for r in done), sum(r.output_tokens for r in done)
    s = {"completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
         "total_input_tokens": total_in, "total_output_tokens": total_out,
         "request_throughput": len(done) / duration, "output_throughput": total_out / duration,
         "total_token_throughput": (total_in + total_out) / duration,
         "tokens_from_usage": all(r.tokens_from_usage for r in done)}
    if goodput:
        s |= goodput_figures(results, duration, goodput)
    for metric, values in lat.items():  # None where nothing was measured (e.g. TPOT of 1-token outputs)
        ms = [1000 * v for v in values]
        s[f"mean_{metric}_ms"] = sum(ms) / len(ms) if ms else None
        s[f"median_{metric}_ms"] = percentile(ms, 50) if ms else None
        s[f"p99_{metric}_ms"] = percentile(ms, 99) if ms else None
    return s


async def benchmark(config: LoadConfig, tokenizer: Tokenizer) -> LoadReport:
    """Build the prompts, send them by the arrival schedule, measure every stream, summarize."""
    check_targets(config.goodput)  # before any request: a typo should not cost a whole run
    prompts = build_prompts(tokenizer, config.num_prompts, config.input_len, config.prefix_len, config.seed,
                            config.token_ids)
    at = send_times(config.num_prompts, config.request_rate, config.seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=config.base_url, timeout=None, limits=limits) as client:
        model = config.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        cap = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else nullcontext()
        bar = tqdm(total=len(prompts), desc="requests", unit="req", disable=not config.progress)

        async def one(i: int) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at[i] - time.perf_counter()))
            async with cap:
                result = await send_request(client, model, prompts[i], config.output_len,
                                            config.prefix_len + config.input_len, config.extra_body)
            bar.update(1)
            return result

        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        duration = time.perf_counter() - start
        bar.close()
    settings = {k: v for k, v in asdict(config).items() if k != "progress"}
    settings["request_rate"] = None if math.isinf(config.request_rate) else config.request_rate  # JSON has no inf
    summary = {"model": model, "config": settings, **summarize(results, duration, config.goodput)}
    return LoadReport(summary, results)


# -----------------------------------------------------------------------------------------------
# Command line: ``minillm bench serve``


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minillm bench serve",
                                description="Load-test an OpenAI-compatible server (vLLM's serving benchmark).")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="the model name to send (default: the server's first)")
    p.add_argument("--tokenizer", default=None, help="a .gguf file or HF folder for the prompts (default: SmolLM2)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=0, help="tokens of random prefix shared by every prompt")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (default: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token-ids", action="store_true", help="send token ids as the prompt instead of text")
    p.add_argument("--goodput", nargs="*", default=[], metavar="NAME:MS",
                   help="latency targets for goodput, e.g. ttft:2000 tpot:200 (names: ttft, tpot, e2el)")
    p.add_argument("--save-json", type=Path, default=None, help="write the summary here")
    return p


def parse_goodput(items: list[str]) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> {"ttft": 200.0, "tpot": 50.0}, checked."""
    targets = {}
    for item in items:
        name, _, ms = item.partition(":")
        try:
            targets[name] = float(ms)
        except ValueError:
            raise ValueError(f"--goodput takes NAME:MILLISECONDS pairs, got {item!r}") from None
    check_targets(targets)
    return targets


def main(argv: list[str] | None = None) -> int:
    from minillm.llm import load_tokenizer
    from minillm.model.fetch import cached_model_path, fetch

    args = build_parser().parse_args(argv)
    config = LoadConfig(args.base_url, args.model, args.num_prompts, args.input_len, args.output_len, args.prefix_len,
                        args.request_rate, args.max_concurrency, args.seed, args.token_ids, parse_goodput(args.goodput))
    tokenizer = load_tokenizer(Path(args.tokenizer) if args.tokenizer else (cached_model_path() or fetch()))
    report = asyncio.run(benchmark(config, tokenizer))
    print(report.table())
    if args.save_json:
        args.save_json.write_text(json.dumps(report.summary, indent=2) + "\n")
        print(f"saved {args.save_json}")
    return 0
