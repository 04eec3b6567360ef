"""Test-suite plumbing: choosing the implementation under test, and the exercise markers.

Every test that grades a learner exercise carries a chapter-task marker (``ch02_rmsnorm`` ...).
It runs against the package by default and against ``exercises/`` with ``--impl=exercises``
(or ``MINILLM_IMPL=exercises``)::

    pytest -m ch02_rmsnorm --impl=exercises
"""
import os
from pathlib import Path

import pytest

from implementations import TASK_MARKER, load_implementation


def pytest_addoption(parser):
    parser.addoption(
        "--impl",
        choices=("minillm", "exercises"),
        default=os.environ.get("MINILLM_IMPL", "minillm"),
        help="grade the package (default) or the learner's exercises/ stubs",
    )


def pytest_collection_modifyitems(config, items):
    """Tag exercise tests; with --impl=exercises keep only them (nothing else has a stub)."""
    keep, dropped = [], []
    for item in items:
        tasks = [m.name for m in item.iter_markers() if TASK_MARKER.match(m.name)]
        if tasks:
            item.add_marker(pytest.mark.exercise)
            item.user_properties.append(("exercise_tasks", ",".join(sorted(set(tasks)))))
        if tasks or config.getoption("--impl") == "minillm":
            keep.append(item)
        else:
            dropped.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture
def impl(request):
    """``impl("ch01_hardware")`` -> the functions an exercise test grades."""
    choice = request.config.getoption("--impl")
    return lambda chapter_module: load_implementation(chapter_module, choice)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 file; `make test` fetches it before the suite runs."""
    from minillm.model.fetch import cached_model_path

    path = cached_model_path()
    if path is None:
        pytest.fail("the default model is not in the cache: run `minillm fetch` (make test does)")
    return path


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """The oracle: transformers' fp32 model and tokenizer built from the same GGUF file (~20 s, once)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": smollm2_path.name}
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path.parent, dtype=torch.float32, **kwargs).eval()
    return model, tokenizer


# The OpenAI client and the served model's name, for every test module that starts a `server` fixture
@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def model(server):
    return server.app.state.model_name
