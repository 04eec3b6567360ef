"""``ServerConfig``: the server's knobs (the engine's are ``EngineConfig``), one command-line flag each.

    minillm serve --max-waiting 64 --api-key KEY     ->  ServerConfig(max_waiting=64, api_key="KEY")

The fields fall in three groups: the HTTP side (``create_app``: names, keys, origins, hosts, body
limit, docs), admission (``AsyncEngine``: queue bounds, per-request limits, the timeout) and the
process (``shutdown.serve`` and the replicas). A value of 0 on the command line for a limit marked
``zero_means_none`` is no limit (None here).
"""
from __future__ import annotations

from dataclasses import dataclass

from minillm.runtime.config import knob
from minillm.serve.body_limit import DEFAULT_MAX_BODY_BYTES
from minillm.serve.router import POLICIES

GRACEFUL_SHUTDOWN_S = 30.0  # on Ctrl-C, in-flight requests get this long to finish before they are aborted


@dataclass(frozen=True)
class ServerConfig:
    host: str = knob("127.0.0.1", "the address to listen on")
    port: int = knob(8000, "the port to listen on")
    served_model_name: str | None = knob(None, 'the name clients send as "model" (default: the file\'s)')
    api_key: str | None = knob(None, "require 'Authorization: Bearer KEY' on /v1/* (default: $MINILLM_API_KEY; "
                                     "none: open)")
    protect_metrics: bool = knob(False, "require the API key on /metrics too")
    allowed_origins: tuple[str, ...] = knob((), 'web origins whose pages may call the API, as JSON, e.g. '
                                                '\'["https://app.example"]\' (default: only the server\'s own chat page)',
                                            json_list="origins")
    allowed_hosts: tuple[str, ...] | None = knob(None, 'Host header names the server answers to besides localhost, '
                                                       '127.0.0.1 and [::1], as JSON, e.g. \'["llm.internal"]\' ("*": '
                                                       'any). Default: on a loopback address only those three (DNS '
                                                       'rebinding protection), elsewhere any', json_list="host names")
    enable_docs: bool = knob(False, "serve FastAPI's /docs and /openapi.json")
    max_body_bytes: int | None = knob(DEFAULT_MAX_BODY_BYTES, "request bodies larger than this get 413 (0: no limit)",
                                      zero_means_none=True)
    # admission (AsyncEngine)
    max_waiting: int = knob(128, "queued requests beyond this get 503")
    max_queued_tokens: int | None = knob(16384, "prompt tokens still to prefill beyond which a new request gets 503 "
                                                "(0: no limit)", zero_means_none=True)
    max_request_tokens: int | None = knob(32768, "the most n x max_tokens one request may ask for (0: no limit)",
                                          zero_means_none=True)
    request_timeout: float | None = knob(600.0, "seconds after which a request is aborted with a 504 (0: never)",
                                         zero_means_none=True)
    log_interval: float = knob(10.0, "seconds between the engine's throughput log lines while it works")
    # the process
    drain_timeout: float = knob(GRACEFUL_SHUTDOWN_S, "on SIGTERM/Ctrl-C, seconds in-flight requests get to finish "
                                                     "before they are aborted")
    log_level: str = knob("info", "the log's threshold", choices=("debug", "info", "warning", "error"))
    replicas: int | None = knob(None, "serve from N engine replicas on Ray Serve (--threads each, default 1) behind "
                                      "one endpoint")
    routing: str | None = knob(None, "how --replicas share the requests (default: cache-aware, to the replica "
                                     "holding the prefix)", choices=POLICIES)
    ray_dashboard: bool = knob(False, "with --replicas: start Ray's dashboard too (on 127.0.0.1; off by default)")

    def __post_init__(self):
        for name in ("allowed_origins", "allowed_hosts"):  # lists welcome; stored as tuples (frozen, hashable)
            if (value := getattr(self, name)) is not None:
                object.__setattr__(self, name, tuple(value))

    def admission(self) -> dict:
        """``AsyncEngine``'s keyword arguments."""
        return dict(max_waiting=self.max_waiting, log_interval=self.log_interval, request_timeout=self.request_timeout,
                    max_request_tokens=self.max_request_tokens, max_queued_tokens=self.max_queued_tokens)

