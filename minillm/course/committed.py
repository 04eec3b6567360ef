"""The committed benchmark figures a chapter prints beside its live ones (benchmarks/results/*.json).

The chapters run in chapters/, the results live in benchmarks/results/ of the same checkout; a file or
key that is missing gives {} so that a chapter prints "not in <file>" instead of failing.
"""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def committed_result(name: str) -> dict:
    """The whole of benchmarks/results/<name>.json, or {} when this checkout does not have it."""
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def committed_decode(engine: str = "minillm", mode: str = "fp32", isa: str = "native") -> dict:
    """decode.json's entry for one (isa, engine, mode), with the file's machine and date added; {} if absent."""
    result = committed_result("decode")
    for entry in result.get("results", {}).get("entries", []):
        if (entry.get("isa"), entry.get("engine"), entry.get("mode")) == (isa, engine, mode):
            return {**entry, "machine": result.get("machine", {}), "date": result.get("date", "")}
    return {}
