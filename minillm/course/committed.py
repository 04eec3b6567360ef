"""The committed benchmark figures a chapter prints beside its live ones (benchmarks/results/*.json).

A figure belongs to the machine that measured it. One benchmark may have several results files,
one per machine (decode.json from one machine, decode_<machine>.json from others: the "benchmark" field
inside each names the benchmark); ``committed_result`` picks the one measured on the learner's
microarchitecture (the LLVM CPU name Numba compiles for) when there is one, and every figure is
printed with ``machine_label``: CPU, microarchitecture, the ISA Numba targeted, cores, and the
package fingerprint measured. A file marked ``"stale"`` (it predates the code it measures, or
does not say which machine measured it) is not printed as a current figure.

The chapters run in chapters/, the results live in benchmarks/results/ of the same checkout; a file or
key that is missing gives {} so that a chapter prints "not in <file>" instead of failing.
"""
from __future__ import annotations

import json
from pathlib import Path

from minillm.hardware.machine import describe_machine

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
STAMP_KEYS = ("cpu", "llvm_cpu", "cores")  # with numba_target.isa: what names a machine


def results_files(benchmark: str) -> dict[str, dict]:
    """Every results file of one benchmark (its "benchmark" field), by file name."""
    files = {}
    for path in sorted(RESULTS.glob(f"{benchmark.split('_')[0]}*.json")):
        result = json.loads(path.read_text())
        if result.get("benchmark") == benchmark:
            files[path.name] = {**result, "file": path.name}
    return files


def committed_result(name: str, microarchitecture: str | None = None) -> dict:
    """The results file of benchmark ``name`` measured on ``microarchitecture`` (default: this
    machine's, e.g. "znver5"), else ``<name>.json``, else any; {} when this checkout has none.
    The result carries "file" (its name) and "same_machine": True, False, or None when the file does
    not record its microarchitecture."""
    files = results_files(name)
    if not files:
        return {}
    here = microarchitecture or describe_machine().llvm_cpu
    same = [r for r in files.values() if r.get("machine", {}).get("llvm_cpu") == here]
    chosen = same[0] if same else files.get(f"{name}.json", next(iter(files.values())))
    recorded = bool(chosen.get("machine", {}).get("llvm_cpu"))
    return {**chosen, "same_machine": True if same else (False if recorded else None)}


def stamped(result: dict) -> bool:
    """The file names its machine (CPU, microarchitecture, Numba's ISA, cores) and the fingerprint measured."""
    machine = result.get("machine", {})
    return (all(machine.get(k) for k in STAMP_KEYS) and bool(machine.get("numba_target", {}).get("isa"))
            and bool(result.get("fingerprint")))


def machine_label(result: dict) -> str:
    """``decode.json: AMD EPYC, znver5, Numba avx512, 2 cores, minillm 3f1c..., 2026-12-01`` -
    what a committed figure is printed with; it says so when the file lacks part of its stamp, when
    it was measured on another microarchitecture than this machine's, and when it is stale."""
    machine = result.get("machine", {})
    parts = [machine.get("cpu", "CPU not recorded"), machine.get("llvm_cpu", "microarchitecture not recorded"),
             f"Numba {machine.get('numba_target', {}).get('isa', 'ISA not recorded')}",
             f"{machine['cores']} cores" if machine.get("cores") else "cores not recorded",
             f"minillm {result['fingerprint']}" if result.get("fingerprint") else "fingerprint not recorded",
             result.get("date", "")[:10] or "undated"]
    label = f"{result.get('file', '?')}: {', '.join(parts)}"
    if result.get("same_machine") is False:
        label += f" - another microarchitecture than this machine's ({describe_machine().llvm_cpu})"
    if result.get("stale"):
        label += f" - STALE: {result['stale']}"
    return label


def committed_decode(engine: str = "minillm", mode: str = "fp32", isa: str = "native") -> dict:
    """The decode results file's entry for one (isa, engine, mode) - of this machine's
    microarchitecture when there is one - with "label" (``machine_label``), "machine", "date",
    "file" and "same_machine" added; {} if absent."""
    result = committed_result("decode")
    for entry in result.get("results", {}).get("entries", []):
        if (entry.get("isa"), entry.get("engine"), entry.get("mode")) == (isa, engine, mode):
            return {**entry, "machine": result.get("machine", {}), "date": result.get("date", ""),
                    "file": result["file"], "same_machine": result["same_machine"], "label": machine_label(result)}
    return {}


def beside(live: str, committed: str | None, result: dict) -> str:
    """One line: the learner's live figure, and the committed one with its machine label - or why
    the committed one is not printed (stale, or not in the file)."""
    if not result:
        return f"{live}  (no committed figure in this checkout)"
    if result.get("stale"):
        return f"{live}  (committed {result.get('file', '?')} not printed: STALE, {result['stale']})"
    if committed is None:
        return f"{live}  (not in {result.get('file', '?')})"
    return f"{live}  | committed {committed} on {machine_label(result)}"
