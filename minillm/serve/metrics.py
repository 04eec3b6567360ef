"""Prometheus metrics under vLLM's names (``minillm:`` instead of ``vllm:``), and a periodic log line.

    gauges      num_requests_running, num_requests_waiting, kv_cache_usage_perc (0..1)
    counters    prompt_tokens, generation_tokens, num_preemptions, prefix_cache_queries,
                prefix_cache_hits (both in tokens), request_success{finished_reason}
    histograms  time_to_first_token_seconds, inter_token_latency_seconds,
                request_time_per_output_token_seconds, e2e_request_latency_seconds,
                request_queue_time_seconds

A finished request's TTFT, ITL, TPOT and E2E come from ``request_latencies`` - the load generator's
(``loadgen.py``), on the engine's timestamps instead of a client's: one definition of each latency
for both ends, called through this module's attribute (``minillm serve --exercises`` puts chapter
09's there).

Every series carries a ``model_name`` label, as vLLM's do, so dashboards built for vLLM work on
``minillm:`` unchanged. Each app owns its registry: two servers in one process (tests, notebooks)
never share or clash over a series. All updates come from the engine thread; prometheus-client is
thread-safe, so ``/metrics`` can be read at any time from the event loop.

Counts are of sequences: ``num_requests_running`` and ``request_success`` count each of a
request's ``n`` completions, as the scheduler sees them.

The engine's own figures (gauges, and its cumulative preemption and prefix-cache counters) are
exported as they stand in its latest ``stats()`` snapshot, which the engine thread hands over
after every step: a scrape reads that snapshot and never touches the engine.
"""
from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from minillm.runtime.engine import EngineStats, Request
from minillm.runtime.sequence import SequenceTimes
from minillm.serve.loadgen import request_latencies

PREFIX = "minillm:"
# Seconds, from a fast GPU's milliseconds to a busy CPU's tens of seconds.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0)

log = logging.getLogger("minillm.serve")


# (series, help, EngineStats field): gauges, then counters (exported with the _total suffix)
ENGINE_GAUGES = (
    ("num_requests_running", "Sequences in the running batch.", "num_running"),
    ("num_requests_waiting", "Sequences waiting to be scheduled.", "num_waiting"),
    ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use, 0 to 1.", "kv_cache_usage"),
)
ENGINE_COUNTERS = (
    ("num_preemptions", "Sequences preempted (their KV freed, to recompute).", "num_preemptions"),
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("spec_decode_num_drafts", "Verify steps that carried a speculative draft.", "spec_decode_num_drafts"),
    ("spec_decode_num_draft_tokens", "Draft tokens proposed.", "spec_decode_num_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", "spec_decode_num_accepted_tokens"),
)


class EngineStatsCollector:
    """The latest ``EngineStats`` as Prometheus series (a custom collector: read at scrape time)."""

    def __init__(self, model_name: str, stats: EngineStats):
        self.model_name, self.stats = model_name, stats

    def collect(self):
        stats = self.stats  # one snapshot for every series of this scrape
        for kind, series in ((GaugeMetricFamily, ENGINE_GAUGES), (CounterMetricFamily, ENGINE_COUNTERS)):
            for name, doc, field in series:
                family = kind(PREFIX + name, doc, labels=["model_name"])
                family.add_metric([self.model_name], getattr(stats, field))
                yield family
        family = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted at each draft position.", labels=["model_name", "position"])
        for position, accepted in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            family.add_metric([self.model_name, str(position)], accepted)
        yield family


class ServerMetrics:
    def __init__(self, model_name: str, stats: EngineStats):
        self.registry = CollectorRegistry()
        label = {"labelnames": ["model_name"], "registry": self.registry}
        self.engine_stats = EngineStatsCollector(model_name, stats)
        self.registry.register(self.engine_stats)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, **label).labels(model_name)

        def histogram(name, doc):
            return Histogram(PREFIX + name, doc, buckets=LATENCY_BUCKETS, **label).labels(model_name)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that produced a token.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.success = Counter(PREFIX + "request_success", "Finished completions, by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.model_name = model_name
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Gap between consecutive tokens of a sequence.")
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Per sequence: (E2E - TTFT) / (output tokens - 1), for two tokens or more.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token of a request.")
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.")

    def observe_step(self, num_generated: int, num_prompt: int) -> None:
        """A step's new tokens, and the prompt tokens of the requests whose first token it made."""
        self.generation_tokens.inc(num_generated)
        self.prompt_tokens.inc(num_prompt)

    def observe_engine(self, stats: EngineStats) -> None:
        """The engine's snapshot after a step: what the next scrape exports."""
        self.engine_stats.stats = stats

    def observe_finished(self, request: Request) -> None:
        times = request.times  # one per completion; they share the arrival and the first schedule
        first = times[0]
        self.queue_time.observe(first.first_scheduled - first.arrival)
        for output in request.outputs:
            self.success.labels(self.model_name, output.finish_reason).inc()
        try:
            self.observe_latencies(times)
        except Exception:  # a learner's request_latencies (serve --exercises) must not stop the engine thread
            log.exception("the latencies of request %s failed: it is left out of the latency histograms",
                          request.request_id)

    def observe_latencies(self, times: list[SequenceTimes]) -> None:
        """Each completion's latencies, from its arrival, the instant of each of its tokens and its end."""
        latencies = [request_latencies(t.arrival, t.tokens, t.finished, len(t.tokens)) for t in times]
        self.ttft.observe(min(lat.ttft for lat in latencies))  # the request's first token, of any completion
        self.e2e.observe(max(lat.e2e for lat in latencies))    # ... and its last
        for lat in latencies:
            for gap in lat.itl:
                self.itl.observe(gap)
            if lat.tpot is not None:
                self.tpot.observe(lat.tpot)

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

    def step(self, stats: EngineStats, num_generated: int, num_prompt: int) -> None:
        self.generation_tokens += num_generated
        self.prompt_tokens += num_prompt
        if time.perf_counter() - self.last >= self.interval:
            self.log(stats)

    def log(self, stats: EngineStats) -> None:
        if not self.generation_tokens:
            return
        seconds = time.perf_counter() - self.last
        queries = stats.prefix_cache_queries
        hit_rate = stats.prefix_cache_hits / queries if queries else 0.0
        log.info("prompt %.1f tok/s, generation %.1f tok/s | running %d, waiting %d | KV cache %.1f%% | "
                 "prefix cache hit rate %.1f%%", self.prompt_tokens / seconds, self.generation_tokens / seconds,
                 stats.num_running, stats.num_waiting, 100 * stats.kv_cache_usage, 100 * hit_rate)
        self.start_window()
