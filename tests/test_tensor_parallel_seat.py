"""Chapter 12's column/row split in the tensor-parallel ranks (course/tensor_parallel_seat.py):
SmolLM2 on 2 ranks, every rank's SwiGLU block through the function the seat installs.

The oracle is the one-process engine's greedy continuation of the same prompt. That the ranks ran
the function given is proven by the function itself: each call appends a line to a file named
after its process (the workers are spawned: they find the folder in the environment they inherit),
and the files are checked against the ranks' own counts and processes. Wrong splits must change
the tokens.
"""
import importlib
import os
from pathlib import Path

import numpy as np
import pytest

from minillm.course import tensor_parallel_seat
from minillm.course.learner_ops import Reach
from minillm.course.tasks import learner_module
from minillm.generation.sampling import SamplingParams
from minillm.llm import LLM
from minillm.model import sharding, transformer
from minillm.model.loader import read_weights

PROMPT, MAX_TOKENS = "The capital of France is", 8
EVIDENCE = "MINILLM_TEST_PAIR_CALLS"   # the folder each process writes its calls into
YOUR_CODE = importlib.import_module("minillm.course.your_code")

# taken when this module is imported - in a worker too, before the seat swaps the attribute
package_column_row_linear = sharding.column_row_linear


def recorded_column_row_linear(x, w_in, w_out, world_size, all_reduce, activation):
    """The package's split, leaving a line in this process's file at each call."""
    with open(Path(os.environ[EVIDENCE]) / str(os.getpid()), "a") as calls:
        calls.write("call\n")
    return package_column_row_linear(x, w_in, w_out, world_size, all_reduce, activation)


def without_the_all_reduce(x, w_in, w_out, world_size, all_reduce, activation):
    """A wrong split: the ranks' partials summed in one process only - each rank keeps its own share."""
    partials = []
    for rank in range(world_size):
        start, stop = sharding.shard_range(w_in.shape[0], world_size, rank)
        partials.append(activation(x @ w_in[start:stop].T) @ w_out[:, start:stop].T)
    return np.sum(partials, axis=0)


def activation_after_the_sum(x, w_in, w_out, world_size, all_reduce, activation):
    """A wrong split: the activation applied to the all-reduced output rather than to each rank's hidden slice."""
    partials = []
    for rank in range(world_size):
        start, stop = sharding.shard_range(w_in.shape[0], world_size, rank)
        partials.append(x @ w_in[start:stop].T @ w_out[:, start:stop].T)
    return activation(all_reduce(partials))


@pytest.fixture(scope="module")
def one_process_tokens(smollm2_path):
    llm = LLM(smollm2_path)
    try:
        output = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    finally:
        llm.close()
    return output[0].outputs[0].token_ids


@pytest.mark.slow
def test_the_ranks_run_the_installed_split_and_give_the_one_process_tokens(smollm2_path, one_process_tokens,
                                                                          tmp_path, monkeypatch):
    monkeypatch.setenv(EVIDENCE, str(tmp_path))
    (tokens,), how, calls = tensor_parallel_seat.run(smollm2_path, PROMPT, MAX_TOKENS, recorded_column_row_linear)
    assert tokens == one_process_tokens and how == "2 ranks"
    n_layers = read_weights(smollm2_path)[0].n_layers
    assert calls == [n_layers * len(tokens)] * 2   # every layer of every forward (one a token), on each rank
    written = {int(f.name): len(f.read_text().splitlines()) for f in tmp_path.iterdir()}
    assert written.pop(os.getpid()) == calls[0]   # rank 0: this process
    assert len(written) == 1 and list(written.values()) == calls[1:]   # rank 1: one other process
    # the seat put this process's attributes back
    assert sharding.column_row_linear is package_column_row_linear
    assert transformer.decoder_layer is importlib.import_module("minillm.model.layers").decoder_layer


@pytest.mark.slow
@pytest.mark.parametrize("wrong", [without_the_all_reduce, activation_after_the_sum],
                         ids=["without the all-reduce", "activation after the sum"])
def test_your_code_sees_a_wrong_split_in_the_ranks(smollm2_path, one_process_tokens, monkeypatch, wrong):
    monkeypatch.setattr(learner_module("ch12_scale_out"), "column_row_linear", wrong)
    reach = Reach()
    package, yours = YOUR_CODE._tensor_parallel(smollm2_path, PROMPT, MAX_TOKENS, ([one_process_tokens], None),
                                                reach)
    assert package[0] == [one_process_tokens]
    assert yours[0] != package[0], f"a split {wrong.__name__.replace('_', ' ')} gave the package's tokens"
    assert reach[tensor_parallel_seat.MARKER] > 0   # it ran, in rank 0 at least, and was counted
    piece = YOUR_CODE._piece(tensor_parallel_seat.MARKER, reach)
    assert piece.whose == "yours" and piece.reached == reach[tensor_parallel_seat.MARKER]
    assert "minillm.model.sharding.column_row_linear" in piece.where


def test_a_function_the_ranks_cannot_import_is_refused_before_any_rank_starts(smollm2_path):
    def local_split(x, w_in, w_out, world_size, all_reduce, activation):
        return package_column_row_linear(x, w_in, w_out, world_size, all_reduce, activation)

    with pytest.raises(ValueError, match="top level of a module"):
        tensor_parallel_seat.run(smollm2_path, PROMPT, MAX_TOKENS, local_split)
