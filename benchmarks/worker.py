"""A contender's process (started by ``common.Worker``; not run by hand).

    python benchmarks/worker.py '{"source": ".../contenders.py", "cls": "Minillm", "kwargs": {...}, "threads": 2}'

Builds the contender and answers one JSON line: ``{"stamp": ...}`` (the contender's stamp plus the
thread and instruction-set variables it was started with), or ``{"error": ...}`` when it cannot be
built. Then for each request line ``{"method", "kwargs"}`` calls that method, timed, and answers
``{"result", "seconds"}``. Ends when its stdin closes. Replies go to the original stdout; anything
the engines print is sent to stderr so it cannot garble a reply.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

from common import ISA_VARS, THREAD_VARS, load_module, timed


def main() -> None:
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    spec = json.loads(sys.argv[1])
    try:
        cls = getattr(load_module(Path(spec["source"])), spec["cls"])
        contender = cls(threads=spec["threads"], **spec["kwargs"])
    except Exception as err:  # reported to the harness, which skips this contender with the reason
        reply({"error": f"{type(err).__name__}: {err}"})
        return
    env = {var: os.environ.get(var) for var in (*THREAD_VARS, *ISA_VARS, "PYTHONPATH")}
    reply({"stamp": {**contender.stamp(), "env": env}})
    for line in sys.stdin:
        request = json.loads(line)
        try:
            result, seconds = timed(getattr(contender, request["method"]), **request["kwargs"])
        except Exception:
            reply({"error": traceback.format_exc()})
            continue
        reply({"result": result, "seconds": seconds})


if __name__ == "__main__":
    main()
