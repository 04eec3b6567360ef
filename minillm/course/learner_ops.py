"""The learner's kernels as one backend, each call counted: what ``your_code`` runs SmolLM2 on.

The exercises backend (``get_backend("exercises")``) says which of the learner's kernels agree
with the reference; here the accepted ones are put where the forward calls them, so that every
kernel task is *reached*, not only swapped in:

    rms_norm, rope, attention_decode, paged_attention_decode    the op itself
    softmax            inside attention: reference.attention (prefill) and, unless the learner's
                       attention_decode is used, reference.attention_decode, run with the
                       learner's softmax in place of the reference's
    qmatvec            Q4_1 linear layers of decode (T <= MATVEC_ROWS_MAX_T rows, one call a row)
    dequantize_q4_1    Q4_1 linear layers of prefill: W dequantized, then ...
    matmul_v3_blocked  ... x @ W.T through the learner's tiled matmul

``Reach`` counts the calls of each task's code during a generation (``counted`` wraps a
function, ``counted_class`` a class, whose constructions it counts).
"""
from __future__ import annotations

import functools
import types
from collections import Counter

import numpy as np

from minillm.course.tasks import task
from minillm.kernels import reference
from minillm.kernels.cpu import quant
from minillm.course.exercises_backend import KERNEL_EXERCISES
from minillm.kernels.registry import Backend, get_backend


class Reach(Counter):
    """task -> calls of the learner's code for it since the last ``clear()``."""

    def counted(self, marker: str, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            self[marker] += 1
            return fn(*args, **kwargs)
        return call

    def counted_class(self, marker: str, cls: type) -> type:
        reach = self

        def __init__(self, *args, **kwargs):
            reach[marker] += 1
            cls.__init__(self, *args, **kwargs)
        return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                           "__qualname__": cls.__qualname__})

    def wrap(self, marker: str, piece):
        return self.counted_class(marker, piece) if isinstance(piece, type) else self.counted(marker, piece)


def with_softmax(fn, softmax):
    """A reference.py function whose body calls ``softmax`` instead of reference.softmax: the
    same code object with that one global rebound (no copy of the attention code, and nothing
    patched that another thread could see)."""
    return types.FunctionType(fn.__code__, {**vars(reference), "softmax": softmax}, fn.__name__, fn.__defaults__)


def accepted_kernels(backend: Backend) -> dict[str, object]:
    """exercise function name -> the learner's function, for the kernels the backend accepted."""
    accepted = {}
    for chapter_module, functions in KERNEL_EXERCISES.items():
        for name, (marker, _) in functions.items():
            if backend.tasks[marker].startswith("yours"):
                module, _ = task(marker)
                accepted[name] = getattr(module, name)
    return accepted


def learner_backend(reach: Reach) -> Backend:
    """The exercises backend with every accepted learner kernel where the forward reaches it, each
    counted in ``reach`` under its task; ``owners`` and ``tasks`` as the exercises backend's."""
    base = get_backend("exercises")
    fns = accepted_kernels(base)
    mine = {name: reach.counted(marker, fns[name]) for functions in KERNEL_EXERCISES.values()
            for name, (marker, _) in functions.items() if name in fns}
    ops = {op: getattr(base, op) for op in base.owners}
    for name, op in (("rms_norm", "rms_norm"), ("rope", "rope"), ("attention_decode", "attention_decode"),
                     ("paged_attention_decode", "paged_attention_decode"), ("matmul_v3_blocked", "matmul")):
        if name in mine:
            ops[op] = mine[name]
    if "softmax" in mine:
        ops["softmax"] = mine["softmax"]
        ops["attention"] = with_softmax(reference.attention, mine["softmax"])
        if "attention_decode" not in mine:
            ops["attention_decode"] = with_softmax(reference.attention_decode, mine["softmax"])
    ops["qlinear"] = learner_qlinear(mine.get("qmatvec"), mine.get("dequantize_q4_1"), mine.get("matmul_v3_blocked"))
    backend = Backend("exercises", ops)
    backend.owners, backend.tasks = base.owners, base.tasks
    return backend


def learner_qlinear(qmatvec, dequantize_q4_1, matmul):
    """qlinear from chapters 02 and 04 (each piece None: the package's), dispatched as
    quant.qlinear does: Q4_1 weights through qmatvec row by row for T <= MATVEC_ROWS_MAX_T, else
    matmul(x, dequantize_q4_1(W).T); other formats (the Q8_0 LM head) through the package's."""
    if qmatvec is None and dequantize_q4_1 is None and matmul is None:
        return quant.qlinear

    def qlinear(x: np.ndarray, qm: quant.QMatrix) -> np.ndarray:
        if qm.qtype != "Q4_1":
            return quant.qlinear(x, qm)                                                   # (T, rows)
        if x.shape[0] <= quant.MATVEC_ROWS_MAX_T:
            if qmatvec is None:
                return quant.qlinear(x, qm)                                               # (T, rows)
            return np.stack([qmatvec(row, qm) for row in x]).reshape(x.shape[0], qm.shape[0])  # (T, rows)
        w = dequantize_q4_1(qm.data, *qm.shape) if dequantize_q4_1 is not None else quant.dequantize(qm)  # (rows, cols)
        x = np.ascontiguousarray(x, dtype=np.float32)                                     # (T, cols)
        return matmul(x, np.ascontiguousarray(w.T)) if matmul is not None else x @ w.T    # (T, rows)
    return qlinear
