"""Chapter 09's seats in the real server: the learner's SSE encoder writes every event of a streamed
completion and the learner's ``request_latencies`` times it in /metrics (``course.server_run``,
the run ``your_code`` makes from chapter 09), and ``minillm serve --exercises`` serves on the
learner's pieces of every chapter."""
import importlib
import json
import os
import re
import signal

import openai
import numpy as np
import pytest

from implementations import REPO, solved_exercises
from serve_process import serve_process
from minillm.course import server_run
from minillm.course.learner_ops import Reach
from minillm.course.seats import learner_seats
from minillm.generation.sampling import SamplingParams
from minillm.llm import LLM
from minillm.model import loader
from minillm.serve.loadgen import Latencies

pytestmark = pytest.mark.slow

PROMPT, MAX_TOKENS = "The capital of France is", 6
AGREE = "TTFT, ITL, TPOT and E2E agree with the stream"


@pytest.fixture(scope="module")
def model(smollm2_path):
    return loader.load_model(smollm2_path)


@pytest.fixture(scope="module")
def greedy_text(smollm2_path):
    """The oracle: the engine's own greedy text, no server between."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return LLM(smollm2_path).generate([PROMPT], params, use_tqdm=False)[0].text


@pytest.fixture(scope="module")
def package_run(smollm2_path, model):
    return server_run.serve_run(smollm2_path, model, PROMPT, MAX_TOKENS)


def seated_run(smollm2_path, model, monkeypatch, **pieces):
    """serve_run with ``pieces`` written in exercises/ch09_server.py and seated: (outcome, reach, swapped)."""
    ch09 = importlib.import_module("exercises.ch09_server")
    for name, piece in pieces.items():
        monkeypatch.setattr(ch09, name, piece)
    reach = Reach()
    with learner_seats("ch09", reach) as swapped:
        outcome = server_run.serve_run(smollm2_path, model, PROMPT, MAX_TOKENS)
    return outcome, reach, swapped


def ascii_sse_event(payload: dict) -> str:
    """A correct encoder other than the package's: json.dumps' defaults (ASCII escapes, spaces)."""
    return "data: " + json.dumps(payload) + "\n\n"


def numpy_request_latencies(sent, content_times, done, output_tokens) -> Latencies:
    """A correct request_latencies other than the package's."""
    if not content_times:
        raise ValueError("no content")
    ttft, e2e = content_times[0] - sent, done - sent
    return Latencies(ttft, np.diff(content_times).tolist(),
                     (e2e - ttft) / (output_tokens - 1) if output_tokens > 1 else None, e2e)


def test_the_package_server_streams_the_engines_text_and_times_it_by_the_definitions(package_run, greedy_text):
    (text, verdict), _ = package_run
    assert text == greedy_text and verdict == AGREE


def test_a_correct_learner_encoder_and_metric_are_reached_in_a_streamed_request(smollm2_path, model, monkeypatch,
                                                                                 package_run):
    outcome, reach, swapped = seated_run(smollm2_path, model, monkeypatch, sse_event=ascii_sse_event,
                                         request_latencies=numpy_request_latencies)
    assert swapped == ["ch09_sse_event", "ch09_metric"]
    assert outcome[0] == package_run[0]
    events = int(outcome[1].split()[0])  # "<n> SSE events, ..."
    assert reach["ch09_sse_event"] == events > MAX_TOKENS  # every event the client parsed: each token's, the usage
    assert reach["ch09_metric"] == 1  # one request of one completion


def test_a_wrong_sse_encoder_is_what_the_client_receives(smollm2_path, model, monkeypatch):
    def indented_sse_event(payload: dict) -> str:  # the JSON over several lines: the data field ends early
        return "data: " + json.dumps(payload, indent=1) + "\n\n"

    (text, _), summary = seated_run(smollm2_path, model, monkeypatch, sse_event=indented_sse_event)[0]
    assert text is None and "not SSE" in summary and "not one JSON document" in summary


def tpot_over_every_token(sent, content_times, done, output_tokens) -> Latencies:
    right = numpy_request_latencies(sent, content_times, done, output_tokens)
    return Latencies(right.ttft, right.itl, (right.e2e - right.ttft) / output_tokens, right.e2e)


def raises(*args):
    raise ZeroDivisionError("a learner's bug")


@pytest.mark.parametrize("wrong, words", [(tpot_over_every_token, "TPOT is"), (raises, "TTFT observed 0 times")])
def test_a_wrong_metric_is_what_metrics_reports_and_the_stream_is_unharmed(smollm2_path, model, monkeypatch,
                                                                           package_run, wrong, words):
    (text, verdict), _ = seated_run(smollm2_path, model, monkeypatch, request_latencies=wrong)[0]
    assert text == package_run[0][0] and words in verdict


# -----------------------------------------------------------------------------------------------
# minillm serve --exercises


def test_serve_exercises_serves_on_the_learners_pieces_and_stops_cleanly(tmp_path, smollm2_path, greedy_text):
    solved = solved_exercises(tmp_path)
    with serve_process(smollm2_path, "--exercises", cwd=REPO, env={**os.environ, "MINILLM_EXERCISES": str(solved)},
                       startup_timeout=120) as (process, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)  # the official client
        model = client.models.list().data[0].id
        chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == greedy_text
        process.send_signal(signal.SIGINT)  # Ctrl-C
        out, _ = process.communicate(timeout=60)
    assert process.returncode == 0, out
    for marker in ("ch02_rmsnorm", "ch07_paged_attention", "ch08_schedule_step", "ch09_sse_event", "ch09_metric"):
        assert re.search(rf"^  {marker}\s+yours\s", out, re.MULTILINE), (marker, out)
    reached = re.search(r"^your pieces reached: (.*)$", out, re.MULTILINE).group(1)
    assert f"ch09_sse_event {len(chunks)}x" in reached and "ch09_metric 1x" in reached, reached
    assert "ch07_paged_attention" in reached and "ch02_rmsnorm" in reached
