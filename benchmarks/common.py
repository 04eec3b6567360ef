"""Shared by every benchmark: results are JSON files stamped with the machine and the versions."""
from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from minillm.hardware.machine import describe_machine, package_versions

RESULTS = Path(__file__).resolve().parent / "results"


def save_result(name: str, results: dict) -> Path:
    """Write ``results/<name>.json`` with the CPU, core count and package versions it ran on."""
    machine = describe_machine()
    payload = {
        "benchmark": name,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": machine.cpu_model, "cores": machine.cores, "memory_bytes": machine.memory_bytes},
        "versions": package_versions(),
        "results": results,
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"saved {path}")
    return path


def load_transformers_model(path: Path, threads: int):
    """The transformers peer: the same GGUF file dequantized to fp32, on `threads` threads -> (torch, model)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return torch, model
