"""Soak test: `minillm serve --api-key` under minutes of mixed traffic, on loopback. Not part of `make test`.

    python benchmarks/soak.py                       # 10 minutes, 4 clients at a time
    python benchmarks/soak.py --minutes 2 --note "a busy machine"

Each minute: clients send a random mix for most of it - streamed and whole chat, completions,
streams they drop after a few events, malformed bodies, requests with no key or a wrong one - then
stop for a quiet period, in which the server must drain to 0 running and 0 % KV use. Recorded:
requests by kind and outcome, errors by status, p50/p99 latency of the answered requests per
minute, the server's RSS per minute, the KV usage after each quiet period, and whether the server
exits 0 on SIGTERM at the end. Goals: no 5xx (none is injected here), RSS growth under 5 % after
the first minute, KV usage 0 after every quiet period. Every request has a client timeout, and the
run is bounded in time.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import numpy as np
import psutil
from common import save_result
from serving import ServerProcess, free_port

from minillm.model.fetch import cached_model_path, fetch

KEY = "soak-key"
QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea.",
             "What is 2 + 2?", "Tell me a story about a cat.", "Why is the sky blue?"]
PROMPTS = ["Once upon a time", "def fibonacci(n):", "The three primary colors are", "Roses are red,"]
# (kind, weight): what a client does next
KINDS = [("chat_stream", 4), ("chat", 3), ("completion", 2), ("completion_stream", 2), ("disconnect", 2),
         ("malformed", 2), ("no_key", 1), ("wrong_key", 1)]
MALFORMED = [b"{not json", b'{"messages": "hi"}', b'{"model": "M", "messages": [], "temperature": -1}',
             b'{"model": "M", "prompt": "x", "max_tokens": "5"}', b"[1, 2, 3]"]


class Soak:
    def __init__(self, url: str, model: str, rng: random.Random, max_tokens: int):
        self.url, self.model, self.rng, self.max_tokens = url, model, rng, max_tokens
        self.outcomes: Counter = Counter()            # (kind, outcome)
        self.statuses: Counter = Counter()            # HTTP status of every answer
        self.latencies: list[float] = []              # answered requests of this minute, seconds

    def body(self, kind: str) -> dict:
        tokens = self.rng.randint(1, self.max_tokens)
        if kind.startswith("chat") or kind in ("no_key", "wrong_key"):
            messages = [{"role": "user", "content": self.rng.choice(QUESTIONS)}]
            return {"model": self.model, "messages": messages, "max_tokens": tokens,
                    "temperature": self.rng.choice([0.0, 0.7])}
        return {"model": self.model, "prompt": self.rng.choice(PROMPTS), "max_tokens": tokens}

    async def one(self, http: httpx.AsyncClient) -> None:
        kind = self.rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
        headers = {"Authorization": f"Bearer {KEY}"}
        route = "/v1/chat/completions" if kind.startswith("chat") or kind.endswith("key") else "/v1/completions"
        start = time.perf_counter()
        try:
            if kind == "malformed":
                content = self.rng.choice(MALFORMED).replace(b'"M"', f'"{self.model}"'.encode())
                response = await http.post(route, content=content,
                                           headers={**headers, "Content-Type": "application/json"})
                self.record(kind, response.status_code, expected=range(400, 500))
                return
            if kind in ("no_key", "wrong_key"):
                bad = {} if kind == "no_key" else {"Authorization": "Bearer wrong"}
                response = await http.post(route, json=self.body(kind), headers=bad)
                self.record(kind, response.status_code, expected=(401,))
                return
            body = self.body(kind)
            if kind.endswith("stream") or kind == "disconnect":
                body["stream"] = True
                drop_after = self.rng.randint(1, 3) if kind == "disconnect" else None
                async with http.stream("POST", route, json=body, headers=headers) as response:
                    events = 0
                    async for line in response.aiter_lines():
                        events += line.startswith("data: ")
                        if '"error"' in line:  # an error event mid-stream is a server failure
                            self.record(kind, 500, expected=())
                            return
                        if drop_after is not None and events >= drop_after:
                            break  # closing the connection: the server must abort and free the blocks
                self.record(kind, response.status_code, expected=(200,))
            else:
                response = await http.post(route, json=body, headers=headers)
                self.record(kind, response.status_code, expected=(200,))
            if kind != "disconnect" and response.status_code == 200:
                self.latencies.append(time.perf_counter() - start)
        except httpx.HTTPError as e:
            self.outcomes[(kind, f"client error: {type(e).__name__}")] += 1

    def record(self, kind: str, status: int, expected) -> None:
        self.statuses[status] += 1
        self.outcomes[(kind, "expected" if status in expected else f"unexpected {status}")] += 1

    async def traffic(self, seconds: float, concurrency: int, timeout: float) -> None:
        deadline = time.monotonic() + seconds
        async with httpx.AsyncClient(base_url=self.url, timeout=timeout) as http:
            async def client():
                while time.monotonic() < deadline:
                    await self.one(http)
            await asyncio.gather(*(client() for _ in range(concurrency)))


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    (line,) = [line for line in text.splitlines() if line.startswith(f"minillm:{name}{{")]
    return float(line.rsplit(" ", 1)[1])


def quiet(url: str, seconds: float) -> dict:
    """Wait (at most ``seconds``) until nothing runs or waits; the KV usage then."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and (metric(url, "num_requests_running") or metric(url, "num_requests_waiting")):
        time.sleep(0.2)
    return {"running": metric(url, "num_requests_running"), "waiting": metric(url, "num_requests_waiting"),
            "kv_cache_usage": metric(url, "kv_cache_usage_perc")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=int, default=10)
    parser.add_argument("--quiet-seconds", type=float, default=10.0, help="the end of each minute: no traffic")
    parser.add_argument("--concurrency", type=int, default=4, help="clients sending at once")
    parser.add_argument("--max-tokens", type=int, default=32, help="each request asks for 1..this many tokens")
    parser.add_argument("--timeout", type=float, default=300.0, help="client timeout per request, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2)")
    parser.add_argument("--note", default="", help="recorded with the results, e.g. how busy the machine was")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if not 0 < args.quiet_seconds < 60:
        parser.error("--quiet-seconds must be in (0, 60)")

    model_path = Path(args.model) if args.model else (cached_model_path() or fetch())
    port = free_port()
    server = ServerProcess([sys.executable, "-m", "minillm.cli", "serve", "--model", str(model_path), "--port",
                            str(port), "--api-key", KEY, "--log-level", "warning"], port, threads=psutil.cpu_count())
    url, deadline = server.url, time.monotonic() + 300
    while True:  # /health: the API itself wants the key
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if server.process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.5)
    process = psutil.Process(server.process.pid)
    model = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"]
    soak = Soak(url, model, random.Random(args.seed), args.max_tokens)

    minutes = []
    for minute in range(args.minutes):
        soak.latencies = []
        asyncio.run(soak.traffic(60 - args.quiet_seconds, args.concurrency, args.timeout))
        after = quiet(url, args.quiet_seconds)
        lat = np.array(soak.latencies) if soak.latencies else np.array([np.nan])
        minutes.append({"minute": minute + 1, "answered": len(soak.latencies),
                        "p50_latency_s": float(np.percentile(lat, 50)), "p99_latency_s": float(np.percentile(lat, 99)),
                        "rss_bytes": process.memory_info().rss, **{f"quiet_{k}": v for k, v in after.items()}})
        print(f"minute {minute + 1}: {minutes[-1]}", flush=True)

    server.process.terminate()  # SIGTERM: the server drains and must exit 0
    exit_status = server.process.wait(timeout=120)
    server.log.close()

    by_kind: dict[str, dict[str, int]] = defaultdict(dict)
    for (kind, outcome), count in sorted(soak.outcomes.items()):
        by_kind[kind][outcome] = count
    rss = [m["rss_bytes"] for m in minutes]
    growth = (max(rss[1:]) - rss[0]) / rss[0] if len(rss) > 1 else 0.0
    server_errors = sum(count for status, count in soak.statuses.items() if status >= 500)
    unexpected = sum(count for (_, outcome), count in soak.outcomes.items() if outcome != "expected")
    goals = {"no_5xx": server_errors == 0, "rss_growth_under_5pct_after_minute_1": growth < 0.05,
             "kv_usage_0_after_every_quiet_period": all(m["quiet_kv_cache_usage"] == 0 for m in minutes),
             "every_outcome_as_expected": unexpected == 0, "sigterm_exit_status_0": exit_status == 0}
    results = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "requests_by_kind_and_outcome": by_kind,
               "responses_by_status": {str(s): c for s, c in sorted(soak.statuses.items())},
               "minutes": minutes, "rss_growth_after_minute_1": growth, "sigterm_exit_status": exit_status,
               "goals": goals, "all_goals_met": all(goals.values())}
    save_result("soak", results, args.out)
    print(f"goals: {goals}")


if __name__ == "__main__":
    main()
