"""Two engine replicas (one thread each) on Ray Serve behind the OpenAI routes, on the real model.

One Ray cluster and one endpoint serve the whole module. A handful of the server suite's cases run
through the router unchanged (imported from test_server.py: the same assertions, this module's
``server``); the rest checks what replicas add: errors and disconnects crossing the actor boundary
leave no KV block held on any replica, concurrent requests spread over both replicas and still
give the one-by-one greedy texts, the cache-aware policy keeps a shared prefix on one replica,
whose prefix cache then hits, and a replica that dies mid-stream ends its request with an error
event while Ray Serve replaces it.
"""
import asyncio
import subprocess
import sys

import httpx
import pytest
import ray

from minillm.llm import chat_prompt
from minillm.runtime.config import EngineConfig
from minillm.serve.app import BackgroundServer
from minillm.serve.config import ServerConfig
from minillm.serve.replicas import Replicas
from test_server import (PROMPTS, QUESTION, chat_whole_and_streamed, greedy_completion, leave_a_long_stream,
                         streamed_greedy_text,  # noqa: F401 (fixtures)
                         test_chat_answers_like_transformers, test_chat_stream_is_the_same_text_in_openai_chunks,
                         test_completion_stops_at_max_tokens, test_models_and_health,
                         test_n_choices_are_indexed_and_each_finishes_once, test_stop_strings_are_cut_out,
                         test_token_id_prompts_equal_text_prompts, test_usage_counts_are_the_tokenizers, wait_until)

pytestmark = pytest.mark.slow

SYSTEM = ("You are a patient assistant for a bicycle repair shop. Answer in one short sentence, name the tool "
          "needed, and never recommend a competitor. Prices are in euros and include labour.")


@pytest.fixture(scope="module")
def replicas(smollm2_path):
    engine = EngineConfig(model=smollm2_path, threads=1, max_num_seqs=32, kv_cache_bytes=32 << 20)
    with Replicas(engine, ServerConfig(replicas=2, routing="cache-aware")) as replicas:
        yield replicas
    ray.shutdown()  # the rest of the suite runs without Ray's processes


@pytest.fixture(scope="module")
def server(replicas):
    with BackgroundServer(replicas.app) as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer(replicas):
    return replicas.tokenizer


def replica_stats(replicas):
    return asyncio.run(replicas.replicas.stats())


def assert_every_replica_idle(replicas) -> None:
    """No request left on any replica and every KV block back in its pool (their engines' own figures)."""
    def idle():
        return all(s.num_running == s.num_waiting == 0 and s.num_free_blocks == s.num_blocks
                   for s in replica_stats(replicas)) and replicas.replicas.in_flight == [0, 0]
    wait_until(idle, "every replica is idle with all its blocks free", timeout=60)


def test_a_replicas_rejection_is_the_same_400_naming_the_field(server, model, replicas):
    """Only the replica's engine checks a prompt + completion against the context: its RequestRejected
    crosses the actor boundary and reaches the client as the one-process server answers it."""
    limit = replicas.limits.max_model_len
    with httpx.Client(base_url=server.url, timeout=None) as http:
        response = http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": limit})
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")
        assert f"maximum context length is {limit} tokens" in error["message"]
        response = http.post("/v1/completions", json={"model": model, "prompt": "hi", "n": 33})
        assert response.status_code == 400 and response.json()["error"]["param"] == "n"
    assert_every_replica_idle(replicas)


def test_concurrent_streams_spread_over_the_replicas_and_give_the_one_by_one_greedy_texts(client, model, server,
                                                                                          replicas):
    ask = dict(model=model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **ask).choices[0].text for p in PROMPTS]
    before = list(replicas.replicas.routed)

    async def all_at_once() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=None) as http:
            return await asyncio.gather(*(streamed_greedy_text(http, model, p) for p in PROMPTS * 2))

    assert asyncio.run(all_at_once()) == alone * 2
    sent = [after - earlier for after, earlier in zip(replicas.replicas.routed, before)]
    assert sum(sent) == 16 and min(sent) > 0  # short prompts have no full block: the least loaded takes each
    assert_every_replica_idle(replicas)


def test_a_client_that_disconnects_mid_stream_frees_its_blocks_on_the_replica(server, model, replicas):
    def running_on_one_replica():  # each replica's snapshot is its latest step's: poll, do not race it
        seen = []  # the last poll's (running, waiting, free blocks) on each replica: a timeout says what it saw

        def one_running() -> bool:
            seen[:] = [(s.num_running, s.num_waiting, s.num_free_blocks) for s in replica_stats(replicas)]
            return sum(running for running, _, _ in seen) == 1
        wait_until(one_running, lambda: f"one replica runs the stream (last seen (running, waiting, free blocks) on "
                                        f"each: {seen}; in flight: {replicas.replicas.in_flight})", timeout=30)

    leave_a_long_stream(server.url, model, running_on_one_replica)
    assert_every_replica_idle(replicas)  # closed: the front cancels the Ray call, the replica aborts it


def test_cache_aware_routing_keeps_a_shared_prefix_on_one_replica_where_it_hits(client, model, replicas):
    block_size = replicas.limits.block_size
    system_blocks = len(chat_prompt(replicas.tokenizer, [{"role": "system", "content": SYSTEM}])) // block_size
    assert system_blocks >= 2  # the shared part spans several full blocks
    before_routed, before = list(replicas.replicas.routed), replica_stats(replicas)
    for question in ("How do I fix a flat tyre?", "My chain skips.", "Brakes squeal.", "Adjust my saddle?"):
        client.chat.completions.create(model=model, max_tokens=2, temperature=0, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    sent = [after - earlier for after, earlier in zip(replicas.replicas.routed, before_routed)]
    assert sorted(sent) == [0, 4]  # one after another, all idle: every one goes where the prefix is
    owner = sent.index(4)
    after = replica_stats(replicas)
    hits = after[owner].prefix_cache_hits - before[owner].prefix_cache_hits
    assert hits >= 3 * system_blocks * block_size  # the 2nd, 3rd and 4th found the system prompt's blocks


def test_bad_replica_settings_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="num_replicas must be >= 1"):
        Replicas(server=ServerConfig(replicas=0))
    with pytest.raises(ValueError, match="threads must be >= 1"):
        Replicas(EngineConfig(threads=0))
    with pytest.raises(ValueError, match="routing must be one of"):
        Replicas(server=ServerConfig(routing="random"))


@pytest.mark.parametrize("flags, message", [
    (["--routing", "round-robin"], "--routing chooses among replicas: give --replicas N too"),
    (["--replicas", "0"], "num_replicas must be >= 1, got 0"),
    (["--replicas", "2", "--routing", "random"], "invalid choice: 'random'"),
])
def test_serve_refuses_bad_replica_flags_by_name(flags, message):
    run = subprocess.run([sys.executable, "-m", "minillm.cli", "serve", *flags], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and message in run.stderr, run.stderr


def weights_reachable(root) -> tuple[set[str], int]:
    """The model objects (``Model``, ``QMatrix``) and the bytes of NumPy arrays reachable from ``root``,
    following every reference except into modules, classes and functions' globals (which reach the
    whole process); closures and bound methods are followed."""
    import gc
    import types

    import numpy as np

    from minillm.kernels.quant_formats import QMatrix
    from minillm.model.transformer import Model

    seen, stack, models, array_bytes = set(), [root], set(), 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (types.ModuleType, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, (Model, QMatrix)):
            models.add(type(obj).__name__)
        if isinstance(obj, np.ndarray):
            array_bytes += obj.nbytes
            continue
        if isinstance(obj, types.FunctionType):
            stack += [*(obj.__closure__ or ()), *(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()]
            continue
        stack += gc.get_referents(obj)
    return models, array_bytes


def test_the_front_holds_no_model_weights_and_no_engine_thread(server, replicas):
    """Before, the front loaded a whole LLM only to tokenize, and its app's engine thread idled."""
    import threading

    models, array_bytes = weights_reachable(replicas)  # the front: its app, client, tokenizer, handles
    assert not models, models
    assert array_bytes < 1 << 20, array_bytes  # the model file is ~100 MB of weights; the tokenizer holds none
    assert not [t.name for t in threading.enumerate() if t.name == "minillm-engine"]


def test_stopping_the_replicas_ends_each_stream_with_an_error_event_and_frees_its_blocks(server, model, replicas):
    """The drain deadline (``shutdown.py``) calls ``client.stop()`` from a thread: every stream on a
    replica ends as the single engine's do, and the replica aborts the request."""
    import json
    import threading

    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 500, "temperature": 0, "stream": True,
            "ignore_eos": True}
    events = []
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        threading.Thread(target=replicas.replicas.stop).start()
        assert events[-1] == "[DONE]" and len(events) < 100, events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["message"] == "the server is shutting down" and error["type"] == "server_error"
        refused = httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=60)
        assert refused.status_code == 503
        assert_every_replica_idle(replicas)  # the Ray call was cancelled: the replica aborted it
    finally:
        replicas.replicas.stopping = False  # the module's last test needs the endpoint serving


def test_a_replica_that_dies_mid_stream_ends_its_request_with_an_error_and_serve_replaces_it(server, model, replicas):
    """Last in the module: kill the actor serving a stream (its process dies as a crash would). The
    client gets an error event, never a hang; Ray Serve starts a new replica and the endpoint serves on."""
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 500, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            busy = replicas.replicas.in_flight.index(1)
            victim = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                          if f"minillm-replica-{busy}" in a["name"] and a["name"].startswith("SERVE_REPLICA"))
            ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]))
            events = [line for line in lines if line.startswith("data: ")]
    assert "the replica serving this request failed" in events[-2] and events[-1] == "data: [DONE]"
    assert replicas.replicas.in_flight == [0, 0]
    wait_until(lambda: httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPTS[1], "max_tokens": 2}).status_code == 200, "the endpoint serves again", 120)
