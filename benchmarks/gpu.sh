#!/usr/bin/env bash
# The GPU check in one command (see benchmarks/gpu.py): tests/cuda on the device, the kernel
# benchmarks, LLM(device="cuda") against transformers -> benchmarks/results/gpu_*.json.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 480 "${PYTHON:-.venv/bin/python}" benchmarks/gpu.py "$@"
