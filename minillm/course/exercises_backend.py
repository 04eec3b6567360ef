"""The learner's kernel backend, "exercises": each operator a learner has written in exercises/
(and that agrees with the reference on a small input) replaces the package's; the rest stay
"numba". ``ops.owners`` says whose each operator is, ``ops.tasks`` whose each kernel exercise is.

The kernels know nothing of exercises/ (they sit two layers below the model, which the stubs
import): this module registers the backend with the kernel registry when minillm.course is
imported, so that afterwards every way of choosing a backend by name takes "exercises"::

    from minillm import course                   # registers it
    minillm.LLM(backend="exercises")             # or load_model(path, backend="exercises")
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

import numpy as np

from minillm.kernels import reference
from minillm.kernels.cpu import quant
from minillm.kernels.quant_formats import QMatrix
from minillm.kernels.registry import OPS, Backend, BackendUnavailable, get_backend, register_backend

CHECKOUT = Path(__file__).resolve().parents[2]  # the minillm checkout: minillm/, exercises/, tests/

_loaded_at: dict[str, float] = {}  # exercise module -> mtime of the file it was imported from


def exercises_folder() -> Path:
    """The learner's exercises: the folder ``$MINILLM_EXERCISES`` names (an ``exercises/`` kept
    elsewhere, say in a repository of the learner's own), else the checkout's, beside minillm/."""
    return Path(os.environ.get("MINILLM_EXERCISES") or CHECKOUT / "exercises").resolve()


def learner_module(chapter_module: str) -> ModuleType:
    """``exercises.<chapter_module>`` as the file on disk now says: re-imported when the learner
    has saved it since it was last imported (a notebook kernel otherwise keeps the old code)."""
    folder = exercises_folder()
    if folder.name != "exercises" or not (folder / "__init__.py").is_file():
        raise BackendUnavailable(f"{folder} is not an exercises/ package (a folder named exercises holding "
                                 "__init__.py): the course needs an editable install of a minillm checkout, "
                                 "and $MINILLM_EXERCISES, if set, must name such a folder")
    if str(folder.parent) not in sys.path:
        sys.path.insert(0, str(folder.parent))
    imported_from = Path(importlib.import_module("exercises").__file__).resolve().parent  # its modules load from there
    if imported_from != folder:
        raise BackendUnavailable(f"this process imported exercises from {imported_from}, not {folder}: "
                                 "restart it after changing $MINILLM_EXERCISES")
    name = f"exercises.{chapter_module}"
    mtime = (folder / f"{chapter_module}.py").stat().st_mtime
    module = importlib.import_module(name)
    if _loaded_at.setdefault(name, mtime) != mtime:
        module = importlib.reload(module)
        _loaded_at[name] = mtime
    return module


def _probes() -> dict[str, tuple]:
    """Small inputs on which each learner function must agree with the reference:
    exercise function -> (args, reference result)."""
    rng = np.random.default_rng(0)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    x, w, logits, a, b = f32(3, 40), f32(40), f32(2, 7), f32(5, 6), f32(6, 4)
    cos, sin = reference.rope_table(8, 16, 10.0)  # (16, 4) each
    q, positions = f32(3, 2, 8), np.array([0, 3, 7])
    q1, k, v = f32(4, 8), f32(6, 2, 8), f32(6, 2, 8)
    qm, row = quant.quantize(f32(8, 64), "Q4_1"), f32(64)
    kc, vc = f32(4, 4, 2, 8), f32(4, 4, 2, 8)
    qb, tables, lens = f32(2, 4, 8), np.array([[2, 0], [3, 1]]), np.array([5, 3])
    return {
        "rms_norm": ((x, w, 1e-5), reference.rms_norm(x, w, 1e-5)),
        "softmax": ((logits,), reference.softmax(logits)),
        "rope": ((q, positions, cos, sin, "half"), reference.rope(q.copy(), positions, cos, sin, "half")),
        "matmul_v3_blocked": ((a, b), reference.matmul(a, b)),
        "attention_decode": ((q1, k, v, 5), reference.attention_decode(q1, k, v, 5)),
        "qmatvec": ((row, qm), reference.qlinear(row[None], qm)[0]),
        "dequantize_q4_1": ((qm.data, *qm.shape), quant.dequantize_reference(qm)),
        "paged_attention_decode": ((qb, kc, vc, tables, lens),
                                   reference.paged_attention_decode(qb, kc, vc, tables, lens)),
    }


# exercise module -> {function: (its task, the op it is, or None for a piece of qlinear)}
KERNEL_EXERCISES = {
    "ch02_cpu_kernels": {"rms_norm": ("ch02_rmsnorm", "rms_norm"), "softmax": ("ch02_softmax", "softmax"),
                         "rope": ("ch02_rope", "rope"), "matmul_v3_blocked": ("ch02_tiled_matmul", "matmul"),
                         "attention_decode": ("ch02_decode_attention", "attention_decode")},
    "ch04_quantization": {"qmatvec": ("ch04_quant_matvec", None), "dequantize_q4_1": ("ch04_q4_1_dequantize", None)},
    "ch07_paged_kv_cache": {"paged_attention_decode": ("ch07_paged_attention", "paged_attention_decode")},
}


def _verdict(fn, args, expected) -> str | None:
    """None if fn agrees with the reference on the probe, else why it is not used."""
    try:
        got = fn(*(a.copy() if isinstance(a, np.ndarray) else a for a in args))
    except NotImplementedError:
        return "not written yet"
    except Exception as err:  # the learner's code crashed: generation must still run, on the package's
        return f"raised {type(err).__name__}: {err}"
    got = np.asarray(got)
    if got.shape != expected.shape or not np.allclose(got, expected, rtol=1e-4, atol=1e-5):
        return "disagrees with the reference on a small input"
    return None


def _learner_qlinear(qmatvec, dequantize_q4_1):
    """qlinear from chapter 04's pieces (either may be None: the package's then), dispatched as
    quant.qlinear does: Q4_1 weights through qmatvec row by row for T <= MATVEC_ROWS_MAX_T, else
    x @ dequantize_q4_1(W).T; other formats (the Q8_0 LM head) through the package's qlinear."""
    def qlinear(x: np.ndarray, qm: QMatrix) -> np.ndarray:
        if qm.qtype != "Q4_1":
            return quant.qlinear(x, qm)
        if x.shape[0] <= quant.MATVEC_ROWS_MAX_T:
            if qmatvec is None:
                return quant.qlinear(x, qm)  # (T, rows)
            return np.stack([qmatvec(row, qm) for row in x]).reshape(x.shape[0], qm.shape[0])  # (T, rows)
        if dequantize_q4_1 is None:
            return quant.qlinear(x, qm)  # (T, rows)
        return np.asarray(x, dtype=np.float32) @ dequantize_q4_1(qm.data, *qm.shape).T  # (T, rows)
    return qlinear


def exercises_backend() -> Backend:
    """The learner's op where it is written and agrees with the reference on a small input, the
    package's ("numba") elsewhere, K/V writes included (no exercise writes them). ``owners[op]``
    says whose each op is, ``tasks[task]`` whose each kernel exercise is, and why not the learner's."""
    numba_ops = get_backend("numba")
    ops = {op: getattr(numba_ops, op) for op in OPS}
    owners, tasks = {op: "package" for op in OPS}, {}
    probes, accepted = _probes(), {}
    for chapter_module, functions in KERNEL_EXERCISES.items():
        module = learner_module(chapter_module)
        for name, (task, op) in functions.items():
            fn = getattr(module, name)
            why_not = _verdict(fn, *probes[name])
            accepted[name] = fn if why_not is None else None
            tasks[task] = f"yours ({task})" if why_not is None else f"package ({task} {why_not})"
            if op is not None and why_not is None:
                ops[op] = fn
            if op is not None:
                owners[op] = tasks[task]
    if accepted["qmatvec"] is not None or accepted["dequantize_q4_1"] is not None:
        ops["qlinear"] = _learner_qlinear(accepted["qmatvec"], accepted["dequantize_q4_1"])
    owners["qlinear"] = f"decode: {tasks['ch04_quant_matvec']}; prefill: {tasks['ch04_q4_1_dequantize']}"
    backend = Backend("exercises", ops)
    backend.owners, backend.tasks = owners, tasks
    return backend


register_backend("exercises", exercises_backend)
