"""The learner's ledger: per task, whether it passed and how fast it ran, kept across sessions in
``$MINILLM_PROGRESS`` (by default ``$MINILLM_HOME/progress.json``, beside the model cache).
``make notebooks`` and ``make test-notebooks`` point it at an empty temporary file, so that
committed outputs and CI never show or change a learner's ledger."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from minillm.model.fetch import model_home


def ledger_path() -> Path:
    return Path(os.environ.get("MINILLM_PROGRESS") or model_home() / "progress.json")


def read_ledger() -> dict[str, dict]:
    """task marker -> its latest record; {} before the first check."""
    path = ledger_path()
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); delete it to start the ledger afresh") from err


def record(marker: str, **fields) -> None:
    """Merge fields into the task's record, stamped with the time (written atomically)."""
    ledger = read_ledger()
    ledger[marker] = {**ledger.get(marker, {}), **fields, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    path = ledger_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    # a file of this process's own, renamed over the ledger: two kernels checking at once each
    # rename a whole file (one shared partial file was truncated under the other's rename). The
    # later of two such records wins: each rewrites the ledger it read
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(ledger, indent=1, sort_keys=True))
    partial.replace(path)


def progress() -> None:
    """Print the ledger, one line per task (every task, the ones not yet tried included). Returns
    None, so that a notebook cell ending with it shows the table only (read_ledger() has the data)."""
    from minillm.course.tasks import all_tasks

    ledger = read_ledger()
    print(f"{'task':<26}{'passed':<9}{'your time':>12}{'package':>12}{'ratio':>8}  when")
    for marker in all_tasks():
        entry = ledger.get(marker, {})
        passed = {True: "yes", False: "no"}.get(entry.get("passed"), "-")
        yours, package = _ms(entry.get("your_s")), _ms(entry.get("package_s"))
        ratio = f"{entry['ratio']:.2f}x" if "ratio" in entry else "-"
        print(f"{marker:<26}{passed:<9}{yours:>12}{package:>12}{ratio:>8}  {entry.get('when', '-')}")
    print(f"(ledger: {ledger_path()})")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f} ms"
