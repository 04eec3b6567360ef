"""N engine replicas on Ray Serve behind one OpenAI-compatible endpoint (**data parallelism**, 数据并行).

Each replica is a whole engine - the model, its own paged KV cache and prefix cache, its engine
thread (``AsyncEngine``) - in a Ray actor of its own, deployed by Ray Serve as one deployment per
replica. In front, in this process, the app of ``minillm serve`` (``create_app``: the same routes,
keys and limits, not a copy) tokenizes, checks, and hands each request to ``ReplicaSet``, the
``EngineClient`` (``client.py``) of the replicas: it asks a policy of ``router.py`` for a replica
and streams that replica's tokens back through Ray Serve's handle (``handle.options(stream=True)``):

    client --HTTP--> routes (tokenize, check) --> ReplicaSet.submit --policy.choose(prompt, loads)-->
        replica-i.generate (Ray Serve streaming call) --> its AsyncEngine --> its LLMEngine
    each step's StepOutputs <-- yielded back, put on the request's RequestStream by a task of the front

The front holds no model: the tokenizer (with the chat template) read from the model file, and
the limits (``EngineLimits``) the replicas' engines report. Its prompt-free checks are those
limits' ``check_params``, the very code each engine runs.

Why not Ray Serve's own ``RequestRouter`` (alpha in 2.60, ``request_router_config``): it would
plug the same policy in, but the replicas' figures reach it through the controller on a polling
period (stale loads), and a caller cannot address one replica to read its prefix-cache counters.
Here the front knows each replica's load exactly (the requests it has in flight there: what the
replica runs or queues), and ``stats()`` asks each replica for its ``EngineStats``.

Errors cross the actor boundary as values (``Refusal``): the engine's ``RequestRejected`` becomes
the same 400 naming the same field, a full queue the same 503, a failure mid-stream the same error
event. A client that leaves cancels the Ray call, and the replica aborts the request; ``stop()``
(the drain deadline) ends every stream in flight with the single engine's error event and
cancels its call. ``/metrics`` of the front is the front's own (no engine steps there); each
replica's figures come from ``stats()``.

    with Replicas(EngineConfig(model), ServerConfig(replicas=2, routing="cache-aware")) as replicas:
        with BackgroundServer(replicas.app) as server: ...      # an OpenAI endpoint at server.url
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from minillm.generation.sampling import SamplingParams
from minillm.llm import LLM, load_tokenizer, model_path
from minillm.runtime.config import EngineConfig, EngineLimits
from minillm.runtime.engine import EngineStats
from minillm.runtime.errors import RequestRejected
from minillm.serve import auth, shutdown
from minillm.serve.app import BackgroundServer, create_app, local_client, served_model_name
from minillm.serve.client import ACCEPTED, SHUTTING_DOWN, EngineFailure, RequestStream
from minillm.serve.config import ServerConfig
from minillm.serve.errors import APIError
from minillm.serve.loadgen import RequestResult, build_prompts, send_request, send_times, summarize
from minillm.serve.metrics import ServerMetrics
from minillm.serve.router import make_policy

RAY_SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": one node, on loopback (start_ray)
RAY_OBJECT_STORE_BYTES = 150 << 20  # the replicas pass small messages only: a small store starts fast
log = logging.getLogger("minillm.serve")


@dataclass
class Refusal:
    """A request's failure, sent back from a replica as a value (exceptions with extra fields do not
    survive pickling): 400 the engine's RequestRejected, 503 a full queue, else an EngineFailure."""
    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def exception(self) -> Exception:
        if self.status == 400:
            return RequestRejected(self.message, self.param, self.code)
        if self.status == 503:
            return APIError(503, self.message)
        failure = EngineFailure(self.message)
        failure.status = self.status  # 500, or 504 for a timeout
        return failure


def internal_refusal(e: Exception) -> Refusal:
    """A bug met inside a replica: logged there in full, sent as the single engine's 500 sentence."""
    log.exception("internal error in a replica")
    return Refusal(500, f"internal error in the engine: {type(e).__name__}: {e}")


# -----------------------------------------------------------------------------------------------
# One replica: an engine in a Ray actor


class EngineReplica:
    """A whole engine in a Ray Serve replica; ``generate`` streams one request's step outputs."""

    def __init__(self, config: EngineConfig, server: ServerConfig):
        """``server``: the admission limits and the served name (``AsyncEngine``'s share of the config)."""
        self.llm = LLM(config)  # config.threads sizes Numba's pool (Ray sets OMP_NUM_THREADS itself)
        self.llm.engine.commit_kv_cache()  # as `minillm serve`: the replica's memory is its size under load
        name = server.served_model_name or served_model_name(self.llm.path)
        self.engine = local_client(self.llm.engine, name, server)
        self.engine.start()

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str):
        """ACCEPTED (or a Refusal), then each step's ``list[StepOutput]`` (or a Refusal mid-stream).
        Every failure leaves as a Refusal carrying the single engine's one-sentence message: an
        exception escaping this generator would reach the client as Ray's whole traceback."""
        try:
            stream = await self.engine.submit(prompt_ids, params, request_id, time.perf_counter())
        except RequestRejected as e:
            yield Refusal(400, e.message, e.param, e.code)
            return
        except (APIError, EngineFailure) as e:
            yield Refusal(e.status, str(e))
            return
        except Exception as e:
            yield internal_refusal(e)
            return
        yield ACCEPTED
        try:  # a cancelled call (the client left) raises CancelledError here: close() aborts the request
            async for outputs in stream:
                yield outputs
        except EngineFailure as e:
            yield Refusal(e.status, str(e))
        except Exception as e:
            yield internal_refusal(e)
        finally:
            stream.close()

    def stats(self) -> EngineStats:
        """The engine's snapshot after its latest step (read without touching the engine)."""
        return self.engine.metrics.engine_stats.stats

    def limits(self) -> EngineLimits:
        return self.llm.engine.limits

    def __del__(self):
        self.engine.stop()


# -----------------------------------------------------------------------------------------------
# The front: the replicas as one EngineClient


def ray_error_name(e: Exception) -> str:
    """``RayActorError``, not ``RayTaskError(ValueError)`` with the replica's traceback."""
    return type(e).__name__.split("(")[0]


@dataclass
class ReplicaCall:
    """One request in flight on one replica: its stream, the Ray call, the task that reads it."""
    stream: RequestStream
    responses: object   # Ray Serve's DeploymentResponseGenerator
    reader: asyncio.Task


class ReplicaSet:
    """The replicas' handles and a routing policy: an ``EngineClient`` (``client.py``)."""

    def __init__(self, handles: list, limits: EngineLimits, routing: str, metrics: ServerMetrics):
        self.handles, self.limits, self.metrics = handles, limits, metrics
        self.policy = make_policy(routing, limits.block_size)
        self.in_flight = [0] * len(handles)  # each replica's load: requests sent there and not finished
        self.routed = [0] * len(handles)     # cumulative: requests sent to each replica
        self.calls: dict[str, ReplicaCall] = {}  # event loop only
        self.loop: asyncio.AbstractEventLoop | None = None  # the one the calls run on (set by submit)
        self.stopping = False
        self.on_death = None                 # shutdown.serve sets it; Ray Serve restarts a replica that dies

    @property
    def alive(self) -> bool:
        return not self.stopping

    def start(self) -> None:
        """Nothing to start here: the replicas run already (``Replicas``)."""

    def stop(self) -> None:
        """New requests get a 503; each request in flight ends with the single engine's error (its
        client gets an error event and [DONE]) and its Ray call is cancelled (the replica aborts it).
        From any thread (the drain deadline calls it from one of its own)."""
        self.stopping = True
        if self.loop is None or self.loop.is_closed():
            return
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self.end_all()
        else:
            self.loop.call_soon_threadsafe(self.end_all)

    def end_all(self) -> None:
        for request_id, call in list(self.calls.items()):
            call.stream.put(EngineFailure(SHUTTING_DOWN))
            self.abort(request_id)

    def check_params(self, params: SamplingParams) -> None:
        """The engine's checks that need no prompt: the replicas' limits, so the very same code."""
        self.limits.check_params(params)

    async def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                     arrival: float) -> RequestStream:
        """Route the request, start it there; returns once that replica accepted it (raises as
        ``AsyncEngine.submit`` does: RequestRejected, APIError 503)."""
        if self.stopping:
            raise APIError(503, "the engine is not running (the server is shutting down)")
        self.loop = asyncio.get_running_loop()
        replica = self.policy.choose(prompt_ids, self.in_flight)
        self.in_flight[replica] += 1
        self.routed[replica] += 1
        responses = self.handles[replica].options(stream=True).generate.remote(prompt_ids, params, request_id)
        stream = RequestStream(request_id, params.n, len(prompt_ids), self.abort)
        reader = asyncio.ensure_future(self.read(replica, responses, stream))
        self.calls[request_id] = ReplicaCall(stream, responses, reader)
        try:
            await stream.accepted()
        except asyncio.CancelledError:  # the client left before the replica answered
            stream.close()
            raise
        return stream

    async def read(self, replica: int, responses, stream: RequestStream) -> None:
        """The replica's items onto the request's stream, until it ends, fails or is cancelled."""
        try:
            async for item in responses:
                if isinstance(item, Refusal):
                    stream.put(item.exception())
                    return
                stream.put(item)
        except asyncio.CancelledError:  # abort(): the stream is closed or ended already
            raise
        except Exception as e:  # the replica's process died, or Ray could not reach it
            # Ray's message is a traceback (paths, pid, ip, colours, actor id): the log gets it, the
            # client one sentence, as the single engine would say it
            log.warning("a replica call failed: %s", e)
            stream.put(EngineFailure(f"the replica serving this request failed ({ray_error_name(e)}); retry the "
                                     f"request"))
        finally:
            self.in_flight[replica] -= 1
            self.calls.pop(stream.request_id, None)

    def abort(self, request_id: str) -> None:
        """Cancel the request's Ray call (the replica aborts it and frees its blocks). On the event loop."""
        if (call := self.calls.get(request_id)) is not None:
            call.responses.cancel()
            call.reader.cancel()

    async def stats(self) -> list[EngineStats]:
        """Each replica's latest ``EngineStats`` (load, KV cache, prefix-cache counters), in order."""
        return list(await asyncio.gather(*(handle.stats.remote() for handle in self.handles)))


# -----------------------------------------------------------------------------------------------
# Starting it all


def start_ray(num_cpus: int, dashboard: bool = False) -> None:
    """A local Ray cluster sized for this box, listening on loopback only: a small object store,
    quiet logs, no dashboard unless asked for (then on 127.0.0.1 too: it can submit jobs, which is
    running code). What the API exposes is ``--host``'s business; Ray's ports are internal.

    Ray 2.60 binds its GCS, raylet and workers' gRPC servers to the node's address, and turns
    ``_node_ip_address="127.0.0.1"`` into the machine's routable address
    (``services.resolve_ip_for_localhost``) - unless clusters are switched off, as Ray does on
    macOS and Windows (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``): then the node's address is the
    loopback one and every server listens there (tests/test_abuse_serve.py lists what listens).
    The variable is read at import and by Ray's child processes, hence both settings below."""
    os.environ[RAY_SINGLE_NODE_ENV] = "0"
    import ray
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # in case ray was imported before the variable was set
    if not ray.is_initialized():
        ray.init(num_cpus=num_cpus, object_store_memory=RAY_OBJECT_STORE_BYTES, include_dashboard=dashboard,
                 _node_ip_address="127.0.0.1", dashboard_host="127.0.0.1", logging_level=logging.ERROR,
                 log_to_driver=False)  # errors only: not its local-cluster notes
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # not a line per deployment step


class Replicas:
    """``server.replicas`` engines (default 2) of ``engine.threads`` threads each (default 1) on Ray
    Serve, and ``app``: the OpenAI routes in front of them, routing by ``server.routing`` (default
    cache-aware; see ``router.POLICIES``). Each replica's ``LLM`` gets ``engine``; the front reads only
    the model's tokenizer. ``server.ray_dashboard``: start Ray's dashboard (``start_ray``)."""

    def __init__(self, engine: EngineConfig = EngineConfig(), server: ServerConfig = ServerConfig()):
        num_replicas = 2 if server.replicas is None else server.replicas
        threads, self.routing = engine.threads or 1, server.routing or "cache-aware"
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        make_policy(self.routing)  # a bad name fails before anything starts
        try:
            from ray import serve
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError(f"replicas run on Ray Serve, which is not installed ({e}): "
                                      f"pip install 'ray[serve]' (make install does)") from None
        self.path = model_path(engine.model)
        self.tokenizer = load_tokenizer(self.path)  # the front's whole share of the model
        engine = dataclasses.replace(engine, model=str(self.path), threads=threads)
        start_ray(num_cpus=num_replicas * threads, dashboard=server.ray_dashboard)
        serve.start(proxy_location="Disabled")  # the endpoint is ours (uvicorn), not Serve's HTTP proxy
        deployment = serve.deployment(EngineReplica, ray_actor_options={"num_cpus": threads},
                                      max_ongoing_requests=server.max_waiting + engine.max_num_seqs,
                                      graceful_shutdown_wait_loop_s=0.2)  # Serve's 2 s: seconds per deletion
        name = server.served_model_name or served_model_name(self.path)
        admission = ServerConfig(served_model_name=name, **server.admission())  # no API key crosses to the actors
        apps = [deployment.options(name=f"replica-{i}").bind(engine, admission) for i in range(num_replicas)]
        self.app_names = [f"minillm-replica-{i}" for i in range(num_replicas)]
        handles = serve.run_many([serve.RunTarget(app, name, route_prefix=None)  # all start at once
                                  for app, name in zip(apps, self.app_names)])
        # every replica runs the same config on the same model: the first one's limits are all of theirs
        self.limits = handles[0].limits.remote().result()
        metrics = ServerMetrics(name, handles[0].stats.remote().result())  # the front's own series
        self.replicas = ReplicaSet(handles, self.limits, self.routing, metrics)
        # the one-process app, whole (routes, API keys, limits, access log), with the replicas as its client
        self.app = create_app(self.replicas, self.tokenizer, self.limits, name, server)

    def shutdown(self) -> None:
        """End what is in flight, delete the replicas (Ray and Serve's controller stay up for the next
        ``Replicas``)."""
        from ray import serve

        self.replicas.stop()
        for name in self.app_names:
            serve.delete(name)

    def __enter__(self) -> Replicas:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


# -----------------------------------------------------------------------------------------------
# Measuring a routing policy: prompts that share a few system prompts


@dataclass
class SharedPrefixWorkload:
    """``num_requests`` prompts, each one of ``num_prefixes`` system prompts (``prefix_len`` random
    tokens) and its own ``suffix_len`` tokens, in a shuffled order (so that no policy is lucky with
    a pattern), sent as token ids at ``request_rate`` per second (Poisson)."""
    num_prefixes: int = 4
    prefix_len: int = 192
    suffix_len: int = 16
    num_requests: int = 24
    output_len: int = 16
    request_rate: float = 1.0
    seed: int = 0

    def prompts(self, tokenizer) -> list[list[int]]:
        per_prefix = -(-self.num_requests // self.num_prefixes)
        groups = [build_prompts(tokenizer, per_prefix, self.suffix_len, self.prefix_len, self.seed + 1 + k,
                                token_ids=True) for k in range(self.num_prefixes)]
        every = [group[i] for i in range(per_prefix) for group in groups][:self.num_requests]
        order = np.random.default_rng(self.seed).permutation(len(every))
        return [every[i] for i in order]


async def send_workload(url: str, model: str, prompts: list[list[int]], output_len: int, request_rate: float,
                        seed: int) -> dict:
    """Send the prompts by ``loadgen``'s arrival schedule, each a ``loadgen`` streamed request; its summary."""
    at = send_times(len(prompts), request_rate, seed)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=httpx.Limits(max_connections=None)) as client:
        async def one(i: int) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at[i] - time.perf_counter()))
            return await send_request(client, model, prompts[i], output_len, len(prompts[i]))

        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        return summarize(results, time.perf_counter() - start)


async def warm_up(replicas: ReplicaSet) -> None:
    """One short request on every replica, past the router: the first steps compile and fill caches."""
    params = SamplingParams(temperature=0.0, max_tokens=2)
    for i, handle in enumerate(replicas.handles):
        async for _ in handle.options(stream=True).generate.remote([1, 2, 3], params, f"warm-up-{i}"):
            pass


async def measure_routing(routing: str, workload: SharedPrefixWorkload, num_replicas: int = 2, threads: int = 1,
                          model: str | Path | None = None, **engine_options) -> dict:
    """Fresh replicas, ``workload`` through the HTTP endpoint: loadgen's figures (TTFT, throughput ...),
    the prefix-cache hit rate over the replicas (prompt tokens found cached / looked up) and the
    requests each replica got. A coroutine, so that a notebook can await it (deleting the replicas
    blocks its loop for seconds: nothing else runs on it meanwhile)."""
    engine = EngineConfig.create(model=model, threads=threads, **engine_options)
    # Starting replicas waits on Ray's answers, which Ray refuses to wait for inside an event loop: a thread does it
    replicas = await asyncio.to_thread(Replicas, engine, ServerConfig(replicas=num_replicas, routing=routing))
    with replicas, BackgroundServer(replicas.app) as server:
        await warm_up(replicas.replicas)
        before, routed = await replicas.replicas.stats(), list(replicas.replicas.routed)
        prompts = workload.prompts(replicas.tokenizer)
        summary = await send_workload(server.url, replicas.app.state.model_name, prompts, workload.output_len,
                                      workload.request_rate, workload.seed)
        after = await replicas.replicas.stats()
        per_replica = [now - then for now, then in zip(replicas.replicas.routed, routed)]
    hits = sum(a.prefix_cache_hits - b.prefix_cache_hits for a, b in zip(after, before))
    queries = sum(a.prefix_cache_queries - b.prefix_cache_queries for a, b in zip(after, before))
    return {"routing": routing, "num_replicas": num_replicas, "threads_per_replica": threads,
            "prefix_cache_hit_rate": hits / queries, "requests_per_replica": per_replica, **summary}


def main(engine: EngineConfig = EngineConfig(), server: ServerConfig = ServerConfig()) -> int:
    """``minillm serve --replicas N``: ``app.main`` with N replicas behind the routes (same options)."""
    logging.basicConfig(level=server.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # a bad combination fails before anything starts
    server = dataclasses.replace(server, api_key=auth.resolve_api_key(server.api_key, server.protect_metrics))
    with Replicas(engine, server) as replicas:
        url = f"http://{server.host}:{server.port}"
        print(f"minillm serving {replicas.app.state.model_name} at {url}/v1 from {len(replicas.app_names)} replicas "
              f"on Ray Serve ({engine.threads or 1} thread(s) each, {replicas.routing} routing). "
              f"Ctrl-C stops it.", flush=True)
        return shutdown.serve(replicas.app, server.host, server.port, server.drain_timeout, server.log_level)
