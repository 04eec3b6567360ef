"""Kernel backends: the model calls every operator through one of these, by name.

    ops = get_backend("numba")   # or "reference" (NumPy, the spec) or "cuda" (Numba CUDA)
    y = ops.linear(x, w)         # the same call, whichever backend

Code above the kernels may add a backend: ``register_backend(name, factory)``, where factory()
builds a ``Backend`` each time get_backend(name) asks for it. The course registers "exercises"
(the learner's kernels, minillm/course/exercises_backend.py) when minillm.course is imported;
this module knows nothing of it beyond its name, for the error that says where it comes from.

A backend is checked when it is built: every name in OPS must be there, so an incomplete backend
fails at load time with the missing names rather than deep inside a forward pass.
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType

from minillm.kernels import cpu, reference

OPS = (
    "matmul", "linear", "embedding", "rms_norm", "rope_table", "rope", "silu", "swiglu", "softmax",
    "attention", "attention_decode", "qlinear", "qembedding",
    "paged_attention_decode", "paged_attention_prefill", "write_kv",
)
BUILT_IN = ("reference", "numba", "cuda")
# Backends that code above registers, and the module whose import does it (named, never imported here).
REGISTERED_BY = {"exercises": "minillm.course"}
_registered: dict[str, Callable[[], "Backend"]] = {}


def _missing(module: ModuleType) -> list[str]:
    return [op for op in OPS if not callable(getattr(module, op, None))]


# Checked at import: a backend module that lost an operator fails here, naming it, not mid-forward.
# (The CUDA module is checked when it is built: importing it needs a GPU or the simulator.)
for _module in (reference, cpu):
    if _missing(_module):
        raise ImportError(f"kernel backend module {_module.__name__} lacks {', '.join(_missing(_module))}")


class BackendUnavailable(RuntimeError):
    """This machine cannot run the backend asked for; the message says why."""


class Backend:
    """The operators of one backend, as attributes: ``ops.rms_norm(x, w, eps)``."""

    def __init__(self, name: str, ops: dict):
        missing = [op for op in OPS if not callable(ops.get(op))]
        if missing:
            raise TypeError(f"kernel backend {name!r} lacks {', '.join(missing)}")
        self.name = name
        self.owners = {op: "package" for op in OPS}  # who wrote each op; a registered backend may say otherwise
        for op in OPS:
            setattr(self, op, ops[op])

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"


def _ops_of(module: ModuleType) -> dict:
    return {op: getattr(module, op, None) for op in OPS}


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
    """The backend called name: "reference", "numba" (the default), "cuda", or one registered.

    The built-in three are built once, then shared; a registered one is built by its factory on
    every call (the course's "exercises" so picks up what the learner has saved since).
    """
    if name in _registered:
        backend = _registered[name]()
        if not isinstance(backend, Backend):
            raise TypeError(f"the factory registered for kernel backend {name!r} returned "
                            f"{type(backend).__name__}, not a Backend")
        return backend
    if name in REGISTERED_BY:
        raise BackendUnavailable(f"the {name!r} kernel backend is registered by {REGISTERED_BY[name]}, which is "
                                 f"not imported yet: run `import {REGISTERED_BY[name]}` first")
    return _build(name)


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    """Make get_backend(name) return factory(), a Backend (with every op of OPS, checked when it
    is built). Registering a name again replaces its factory (a re-imported module registers anew);
    the built-in names cannot be taken."""
    if name in BUILT_IN:
        raise ValueError(f"{name!r} is a built-in kernel backend; register under another name")
    if not callable(factory):
        raise TypeError(f"register_backend({name!r}, ...) needs a callable that builds a Backend, "
                        f"got {type(factory).__name__}")
    _registered[name] = factory


@functools.cache
def _build(name: str) -> Backend:
    """One module per backend, each exposing every op of OPS under the same name."""
    if name == "reference":
        return Backend(name, _ops_of(reference))
    if name == "numba":
        return Backend(name, _ops_of(cpu))
    if name == "cuda":
        # The paged KV cache lives in host memory, so the CUDA paged kernels copy the cache to the
        # device on each call (a CUDA paged cache would keep its blocks there).
        return Backend(name, _ops_of(_cuda_module()))
    raise ValueError(f"unknown kernel backend {name!r}; choose one of {', '.join(backend_names())}")


def backend_names() -> list[str]:
    """Every name get_backend knows: the built-in ones, then the registered ones."""
    return [*BUILT_IN, *_registered]


def available_backends() -> list[str]:
    """The backends this machine can run ("cuda" only with a GPU or the CUDA simulator)."""
    names = ["reference", "numba"]
    try:
        get_backend("cuda")
    except BackendUnavailable:
        return names
    return names + ["cuda"]
