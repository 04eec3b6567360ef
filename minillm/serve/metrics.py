"""Prometheus metrics under vLLM's names (``minillm:`` instead of ``vllm:``), and a periodic log line.

    gauges      num_requests_running, num_requests_waiting, kv_cache_usage_perc (0..1)
    counters    prompt_tokens, generation_tokens, num_preemptions, prefix_cache_queries,
                prefix_cache_hits (both in tokens), request_success{finished_reason}
    histograms  time_to_first_token_seconds, inter_token_latency_seconds,
                e2e_request_latency_seconds, request_queue_time_seconds

Every series carries a ``model_name`` label, as vLLM's do, so dashboards built for vLLM work on
``minillm:`` unchanged. Each app owns its registry: two servers in one process (tests, notebooks)
never share or clash over a series. All updates come from the engine thread; prometheus-client is
thread-safe, so ``/metrics`` can be read at any time from the event loop.

Counts are of sequences: ``num_requests_running`` and ``request_success`` count each of a
request's ``n`` completions, as the scheduler sees them.
"""
from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from minillm.runtime.engine import LLMEngine, Request

PREFIX = "minillm:"
# Seconds, from a fast GPU's milliseconds to a busy CPU's tens of seconds.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0)

log = logging.getLogger("minillm.serve")


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        label = {"labelnames": ["model_name"], "registry": self.registry}

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, **label).labels(model_name)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, **label).labels(model_name)

        def histogram(name, doc):
            return Histogram(PREFIX + name, doc, buckets=LATENCY_BUCKETS, **label).labels(model_name)

        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use, 0 to 1.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that produced a token.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.preemptions = counter("num_preemptions", "Sequences preempted (their KV freed, to recompute).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.success = Counter(PREFIX + "request_success", "Finished completions, by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.model_name = model_name
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Gap between consecutive tokens of a sequence.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token of a request.")
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.")
        self.seen = {"preemptions": 0, "queries": 0, "hits": 0}  # engine totals already counted

    def observe_step(self, num_generated: int, num_prompt: int) -> None:
        """A step's new tokens, and the prompt tokens of the requests whose first token it made."""
        self.generation_tokens.inc(num_generated)
        self.prompt_tokens.inc(num_prompt)

    def observe_engine(self, engine: LLMEngine) -> None:
        """The engine's state now: gauges, and the growth of its running totals."""
        self.running.set(engine.num_running)
        self.waiting.set(engine.num_waiting)
        bm = engine.block_manager
        self.kv_usage.set(bm.usage)
        for key, total, counter in (("preemptions", engine.scheduler.num_preemptions, self.preemptions),
                                    ("queries", bm.prefix_cache_queries, self.prefix_queries),
                                    ("hits", bm.prefix_cache_hits, self.prefix_hits)):
            counter.inc(total - self.seen[key])
            self.seen[key] = total

    def observe_finished(self, request: Request) -> None:
        first = request.seqs[0].times
        self.queue_time.observe(first.first_scheduled - first.arrival)
        self.ttft.observe(min(s.times.first_token for s in request.seqs) - first.arrival)
        self.e2e.observe(max(s.times.finished for s in request.seqs) - first.arrival)
        for seq in request.seqs:
            for earlier, later in zip(seq.times.tokens, seq.times.tokens[1:]):
                self.itl.observe(later - earlier)
            self.success.labels(self.model_name, seq.builder.output.finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatsLogger:
    """One line every ``interval`` seconds while the engine works, and one when a burst of work ends:
    throughput, queue, cache. Idle time is left out of the throughput."""

    def __init__(self, interval: float = 10.0):
        self.interval = interval
        self.start_window()

    def start_window(self) -> None:
        self.last = time.perf_counter()
        self.prompt_tokens = self.generation_tokens = 0

    def step(self, engine: LLMEngine, num_generated: int, num_prompt: int) -> None:
        self.generation_tokens += num_generated
        self.prompt_tokens += num_prompt
        if time.perf_counter() - self.last >= self.interval:
            self.log(engine)

    def log(self, engine: LLMEngine) -> None:
        if not self.generation_tokens:
            return
        now = time.perf_counter()
        bm, seconds = engine.block_manager, now - self.last
        hit_rate = bm.prefix_cache_hits / bm.prefix_cache_queries if bm.prefix_cache_queries else 0.0
        log.info("prompt %.1f tok/s, generation %.1f tok/s | running %d, waiting %d | KV cache %.1f%% | "
                 "prefix cache hit rate %.1f%%", self.prompt_tokens / seconds, self.generation_tokens / seconds,
                 engine.num_running, engine.num_waiting, 100 * bm.usage, 100 * hit_rate)
        self.start_window()
