"""Kernel backends: the model calls every operator through one of these, by name.

    ops = get_backend("numba")   # or "reference" (NumPy, the spec) or "cuda" (Numba CUDA)
    y = ops.linear(x, w)         # the same call, whichever backend

A backend is checked when it is built: every name in OPS must be there, so an incomplete backend
fails at load time with the missing names rather than deep inside a forward pass.
"""
from __future__ import annotations

import functools
import importlib
from types import ModuleType

import numpy as np

from minillm.kernels import shapes
from minillm.kernels.quant import QMatrix, dequantize_reference

OPS = (
    "matmul", "linear", "embedding", "rms_norm", "rope_table", "rope", "silu", "swiglu", "softmax",
    "attention", "attention_decode", "qlinear", "qembedding",
    "paged_attention_decode", "paged_attention_prefill",
)
BACKENDS = ("reference", "numba", "cuda")


class BackendUnavailable(RuntimeError):
    """This machine cannot run the backend asked for; the message says why."""


class Backend:
    """The operators of one backend, as attributes: ``ops.rms_norm(x, w, eps)``."""

    def __init__(self, name: str, ops: dict):
        missing = [op for op in OPS if not callable(ops.get(op))]
        if missing:
            raise TypeError(f"kernel backend {name!r} lacks {', '.join(missing)}")
        self.name = name
        for op in OPS:
            setattr(self, op, ops[op])

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"


def qembedding_reference(ids: np.ndarray, qm: QMatrix) -> np.ndarray:
    """The rows of a quantized table named by ids (T,) -> (T, cols), dequantized by the NumPy spec."""
    shapes.check_embedding(ids, qm)
    rows = QMatrix(qm.qtype, (ids.shape[0], qm.shape[1]), qm.data[ids])  # only these rows' blocks
    return dequantize_reference(rows)  # (T, cols)


def _ops_of(module: ModuleType, **more) -> dict:
    return {op: getattr(module, op, None) for op in OPS} | more


def _cuda_module() -> ModuleType:
    try:
        from numba import cuda
    except ImportError as err:
        raise BackendUnavailable(f"the cuda backend needs the numba-cuda package: {err}") from err
    if not cuda.is_available():
        raise BackendUnavailable(
            "the cuda backend found no usable CUDA GPU (numba.cuda.is_available() is False); "
            "to run its kernels on the CPU simulator, set NUMBA_ENABLE_CUDASIM=1 before numba is imported"
        )
    try:
        return importlib.import_module("minillm.kernels.cuda")
    except ImportError as err:
        raise BackendUnavailable(f"minillm.kernels.cuda could not be imported: {err}") from err


def get_backend(name: str = "numba") -> Backend:
    """The backend called name: "reference", "numba" (the default) or "cuda"; built once, then shared."""
    return _build(name)


@functools.cache
def _build(name: str) -> Backend:
    from minillm.kernels import paged_attention as paged

    if name == "reference":
        from minillm.kernels import quant, reference
        return Backend(name, _ops_of(reference, qlinear=quant.qlinear_reference, qembedding=qembedding_reference,
                                     paged_attention_decode=paged.paged_attention_decode_reference,
                                     paged_attention_prefill=paged.paged_attention_prefill_reference))
    if name == "numba":
        from minillm.kernels import cpu, quant
        return Backend(name, _ops_of(cpu, qlinear=quant.qlinear, qembedding=quant.qembedding,
                                     paged_attention_decode=paged.paged_attention_decode,
                                     paged_attention_prefill=paged.paged_attention_prefill))
    if name == "cuda":
        # Every operator, paged attention included, from minillm.kernels.cuda. The paged KV cache
        # lives in host memory, so its paged kernels copy the cache to the device on each call (a
        # CUDA paged cache would keep its blocks there).
        return Backend(name, _ops_of(_cuda_module()))
    raise ValueError(f"unknown kernel backend {name!r}; choose one of {', '.join(BACKENDS)}")


def available_backends() -> list[str]:
    """The backends this machine can run ("cuda" only with a GPU or the CUDA simulator)."""
    names = ["reference", "numba"]
    try:
        get_backend("cuda")
    except BackendUnavailable:
        return names
    return names + ["cuda"]
