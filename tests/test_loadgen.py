"""The load generator's arithmetic on given numbers (NumPy as the oracle), its arrival schedule and
its prompts. The run against a live server is in test_server.py."""
import math

import numpy as np
import pytest

from minillm.serve import loadgen
from minillm.serve.loadgen import (Latencies, RequestResult, build_prompts, goodput_figures, meets_targets,
                                   parse_goodput, percentile, send_times, summarize)


@pytest.mark.ch09_metric
def test_latencies_of_one_stream(impl):
    # sent at 10.0; text chunks at 10.5, 10.7, 11.0, 11.6; [DONE] at 11.7; 5 tokens (one chunk held 2)
    lat = impl("ch09_server").request_latencies(10.0, [10.5, 10.7, 11.0, 11.6], 11.7, 5)
    assert lat.ttft == pytest.approx(0.5)
    assert lat.itl == pytest.approx([0.2, 0.3, 0.6])
    assert lat.e2e == pytest.approx(1.7)
    assert lat.tpot == pytest.approx((1.7 - 0.5) / 4)


@pytest.mark.ch09_metric
def test_a_single_token_has_no_tpot_and_no_text_is_an_error(impl):
    ops = impl("ch09_server")
    lat = ops.request_latencies(0.0, [0.25], 0.3, 1)
    assert (lat.ttft, lat.itl, lat.tpot) == (0.25, [], None) and lat.e2e == pytest.approx(0.3)
    with pytest.raises(ValueError):
        ops.request_latencies(0.0, [], 0.3, 0)


@pytest.mark.ch09_metric
def test_tpot_spreads_time_over_tokens_while_itl_sees_chunks(impl):
    rng = np.random.default_rng(0)
    for _ in range(20):
        times = np.cumsum(rng.uniform(0.01, 0.5, size=rng.integers(2, 30)))  # (C,) chunk arrivals
        tokens = len(times) + int(rng.integers(0, 5))                        # some chunks held 2 tokens
        done = times[-1] + 0.01
        lat = impl("ch09_server").request_latencies(0.0, times.tolist(), done, tokens)
        assert lat.itl == pytest.approx(np.diff(times).tolist())
        assert lat.tpot == pytest.approx((done - times[0]) / (tokens - 1))


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101])
def test_percentile_matches_numpy(n):
    values = np.random.default_rng(n).exponential(size=n).tolist()
    for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12)
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_summary_on_given_requests():
    results = [RequestResult(True, 10, 4, Latencies(0.1, [0.2, 0.2, 0.2], 0.2, 0.8)),
               RequestResult(True, 20, 4, Latencies(0.3, [0.1, 0.5, 0.3], 0.3, 1.2)),
               RequestResult(False, error="HTTP 503")]
    s = summarize(results, duration=2.0, goodput={"ttft": 200, "tpot": 250})
    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (2, 1, 30, 8)
    assert (s["request_throughput"], s["output_throughput"], s["total_token_throughput"]) == (1.0, 4.0, 19.0)
    assert s["request_goodput"] == 0.5  # only the first meets TTFT <= 200 ms and TPOT <= 250 ms
    assert s["goodput_fraction"] == pytest.approx(1 / 3)  # of the three sent: the failed one met nothing
    assert s["mean_ttft_ms"] == pytest.approx(200) and s["median_e2el_ms"] == pytest.approx(1000)
    itl_ms = [200, 200, 200, 100, 500, 300]
    assert s["p99_itl_ms"] == pytest.approx(np.percentile(itl_ms, 99))
    assert s["mean_tpot_ms"] == pytest.approx(250)
    with pytest.raises(ValueError, match="unknown goodput"):
        meets_targets(results[0].latencies, {"latency": 1})


def test_goodput_counts_requests_meeting_every_target_like_vllm():
    """vLLM's rule, brute-forced with NumPy: a request is good when each latency named in the targets
    is within its target; a one-token answer (no TPOT) counts as TPOT 0; failures are never good."""
    rng = np.random.default_rng(4)
    n = 200
    ttft, tpot, e2e = rng.uniform(0, 0.4, n), rng.uniform(0, 0.1, n), rng.uniform(0, 3, n)  # (n,) seconds
    single = rng.random(n) < 0.1                                                          # (n,) one token
    failed = rng.random(n) < 0.05                                                         # (n,)
    results = [RequestResult(False, error="HTTP 503") if failed[i] else
               RequestResult(True, 8, 1 if single[i] else 9,
                             Latencies(ttft[i], [], None if single[i] else tpot[i], e2e[i])) for i in range(n)]
    tpot_ms = np.where(single, 0, 1000 * tpot)
    for targets in ({"ttft": 200, "tpot": 50}, {"ttft": 300}, {"tpot": 20, "e2el": 1500}, {"e2el": 0}):
        limits = {"ttft": 1000 * ttft, "tpot": tpot_ms, "e2el": 1000 * e2e}
        good = ~failed & np.all([limits[name] <= ms for name, ms in targets.items()], axis=0)  # (n,)
        figures = goodput_figures(results, 8.0, targets)
        assert figures["goodput_fraction"] == good.sum() / n
        assert figures["request_goodput"] == good.sum() / 8.0
        assert figures["goodput_targets_ms"] == targets


def test_goodput_targets_are_checked_before_a_run():
    assert parse_goodput(["ttft:200", "tpot:50", "e2el:1e4"]) == {"ttft": 200, "tpot": 50, "e2el": 10000}
    for items, words in ((["ttft=200"], "NAME:MILLISECONDS"), (["latency:5"], "unknown goodput targets"),
                         (["tpot:-1"], ">= 0 ms"), (["ttft:nan"], ">= 0 ms")):
        with pytest.raises(ValueError, match=words):
            parse_goodput(items)


def test_the_progress_bar_is_plain_text():
    assert loadgen.tqdm.__module__ == "tqdm.std"  # tqdm.auto would draw notebook widgets from a CLI tool


def test_arrivals_all_at_once_or_poisson():
    assert send_times(5, math.inf).tolist() == [0.0] * 5
    at = send_times(20000, 4.0, seed=1)
    assert at[0] == 0 and np.all(np.diff(at) >= 0)
    assert np.mean(np.diff(at)) == pytest.approx(0.25, rel=0.03)  # exponential gaps of mean 1/rate
    assert np.array_equal(at, send_times(20000, 4.0, seed=1))


@pytest.mark.slow
def test_prompts_are_exactly_the_asked_number_of_tokens(smollm2_path):
    from minillm.llm import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    texts = build_prompts(tok, 6, 40, prefix_len=16, seed=3)
    assert [len(tok.encode(t)) for t in texts] == [56] * 6
    ids = build_prompts(tok, 3, 40, prefix_len=16, seed=3, token_ids=True)
    assert all(len(p) == 56 and p[:16] == ids[0][:16] for p in ids)  # one shared prefix
    assert not set(sum(ids, [])) & tok.special_ids
