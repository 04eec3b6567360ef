"""Chapter 12's column/row split where tensor parallelism runs it: SmolLM2 on 2 ranks (spawned
processes, torch.distributed over gloo), every rank's SwiGLU block computed by
``minillm.model.sharding.column_row_linear`` - the learner's, once written - on its own shard.

A rank holds F_r of the F feed-forward units (Shard.plan): their rows of gate and up
(column-parallel) and their input columns of down (row-parallel). Its block calls

    column_row_linear(x, w_in, w_out, world_size, all_reduce, activation)
      x           the rank's RMS-normed hidden states (N, D)
      w_in        its gate rows (F_r, D), dequantized: the function's contract is dense arrays
      w_out       its down columns (D, F_r), dequantized
      world_size  1: the rank is the function's only rank in its process; the other ranks are
                  the other processes
      all_reduce  the group's: the one partial (N, D) summed over the processes
      activation  silu(h) * up, up = x @ (its up rows).T by the packed kernel: SwiGLU's gated
                  product, elementwise over the rank's F_r units

The attention block, the embedding, the LM head and the engine are the package's. So the run
proves the learner's pair in a real group - its two products, where the activation goes, its one
all-reduce, and that the ranks' partial outputs add up to the model's - but not its split of one
matrix over several ranks in one call (world_size is 1 here; chapter 12's tests split over 1 to 4).

The engine's ranks do not run their MLP this way outside the course: they keep gate and up stacked
and packed (one quantized matvec for both) and down packed, while the function takes dense
matrices and an elementwise activation. The course's decoder layer below swaps in for the
package's in every rank's process, as chapter 03's does in its own (cuda_seat.py).

Workers are fresh processes: each is told the module and name of the function to run
(TensorParallelGroup's ``setup``), imports it, and counts its calls; rank 0, this process, does the
same for the run's length. After the run rank 0 asks every rank for its count
(TensorParallelGroup.collect): the seat is reached when the ranks say they called it.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from minillm.course.learner_ops import Reach
from minillm.kernels.cpu.quant import dequantize
from minillm.kernels.quant_formats import QMatrix
from minillm.model import sharding, transformer
from minillm.model.layers import Weight, linear, self_attention

MARKER = "ch12_column_row_linear"
TP_SIZE = 2
TP_KV_CACHE_BYTES = 32 << 20   # one request: a small cache per rank is plenty

CALLS = Reach()   # this process's calls of the installed function
_dense: dict[int, tuple[Weight, np.ndarray]] = {}   # id(packed weight) -> (it, its fp32 matrix), kept for the run


def dense(w: Weight) -> np.ndarray:
    """The weight as an fp32 matrix: a packed one dequantized once per process and run."""
    if not isinstance(w, QMatrix):
        return w
    if id(w) not in _dense:
        _dense[id(w)] = (w, dequantize(w))   # holding w keeps its id from being reused
    return _dense[id(w)][1]


def pair_mlp(x: np.ndarray, weights, ctx) -> np.ndarray:
    """The rank's SwiGLU block through sharding.column_row_linear (see above): x (N, D) -> the
    block's output (N, D), already summed over the ranks."""
    up = linear(x, weights.w_up, ctx.ops)   # (N, F_r)

    def gated(h: np.ndarray) -> np.ndarray:   # (N, F_r) -> (N, F_r): silu(gate) * up, unit by unit
        if np.shape(h) != up.shape:
            raise ValueError(f"this rank's activation takes the hidden layer of all its units, {up.shape}; "
                             f"got {np.shape(h)}")
        return ctx.ops.swiglu(np.asarray(h, dtype=np.float32), up)

    def all_reduce(partials: list[np.ndarray]) -> np.ndarray:   # this process's partials -> the group's sum
        return ctx.all_reduce(np.asarray(np.sum(partials, axis=0), dtype=np.float32))   # (N, D)

    y = sharding.column_row_linear(x, dense(weights.w_gate), dense(weights.w_down), 1, all_reduce, gated)
    return np.asarray(y, dtype=np.float32)   # (N, D)


def pair_decoder_layer(x: np.ndarray, weights, layer: int, cache, meta, ctx) -> np.ndarray:
    """layers.decoder_layer with its MLP through ``pair_mlp`` (the attention block is its own, step for step)."""
    eps, ops = ctx.config.rms_eps, ctx.ops
    h = x + ctx.all_reduce(self_attention(ops.rms_norm(x, weights.attn_norm, eps), weights, layer, cache, meta, ctx))
    return h + pair_mlp(ops.rms_norm(h, weights.mlp_norm, eps), weights, ctx)


def imported(module: str, name: str):
    """``module.name``, imported: what a worker runs (``name`` may be dotted, a class's method)."""
    return functools.reduce(getattr, name.split("."), importlib.import_module(module))


def importable(fn) -> tuple[str, str]:
    """(module, name) by which a worker imports ``fn``; a function it could not import is refused here."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    try:
        found = imported(module, name)
    except (AttributeError, ImportError, TypeError, ValueError):
        found = None
    if found is not fn:
        raise ValueError(f"the tensor-parallel ranks import column_row_linear by its module and name, and "
                         f"{fn!r} cannot be imported so: write it as a function at the top level of a module")
    return module, name


def install(module: str, name: str) -> None:
    """A worker's setup, before it loads its shard: its decoder layers run their MLP through
    ``module.name``, counted in CALLS. (The worker is the run's own process: nothing to put back.)"""
    sharding.column_row_linear = CALLS.counted(MARKER, imported(module, name))
    transformer.decoder_layer = pair_decoder_layer


@contextlib.contextmanager
def installed(module: str, name: str) -> Iterator[None]:
    """``install`` in this process (rank 0) for the block; everything put back and forgotten after it."""
    originals = sharding.column_row_linear, transformer.decoder_layer
    CALLS.clear()
    try:
        install(module, name)
        yield
    finally:
        sharding.column_row_linear, transformer.decoder_layer = originals
        _dense.clear()


def calls_here() -> int:
    """A rank's answer to TensorParallelGroup.collect: its calls of the installed function."""
    return CALLS[MARKER]


def run(path: Path, prompt: str, max_tokens: int, fn) -> tuple[list[list[int]], str, list[int | None]]:
    """The greedy request on TP_SIZE ranks whose MLPs run through ``fn``: ([its tokens], what
    happened, each rank's calls of fn). A run the ranks could not finish - fn raised, or a rank
    died - has no tokens, says why, and knows rank 0's calls only."""
    from minillm.generation.sampling import SamplingParams
    from minillm.llm import load_tokenizer
    from minillm.runtime.engine import LLMEngine
    from minillm.runtime.tensor_parallel import RankFailed, TensorParallelGroup

    module, name = importable(fn)
    tokenizer = load_tokenizer(path)
    group = TensorParallelGroup(path, TP_SIZE, setup=functools.partial(install, module, name))
    try:
        with installed(module, name):
            try:
                engine = LLMEngine(group.model, tokenizer, kv_cache_bytes=TP_KV_CACHE_BYTES, tensor_parallel=group)
                request = engine.add_request(tokenizer.encode(prompt),
                                             SamplingParams(temperature=0.0, max_tokens=max_tokens))
                while engine.has_unfinished():
                    engine.step()
                tokens = engine.pop_request(request).outputs[0].token_ids
                return [tokens], f"{TP_SIZE} ranks", group.collect(calls_here)
            except RankFailed as err:   # the function's own error, when it raised one, is the context
                cause = err.__cause__ or err.__context__
                why = f"the group failed: {err}" + (f" ({type(cause).__name__}: {cause})" if cause else "")
                return [[]], why, [calls_here()] + [None] * (TP_SIZE - 1)
    finally:
        group.close()
