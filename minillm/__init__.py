"""minillm: an LLM inference engine built from scratch, layer by layer.

Layers (each a sub-package, importing only the layers below it):
hardware -> kernels -> model -> generation -> runtime -> serve.

    import minillm
    llm = minillm.LLM()
    llm.generate(["Once upon a time"], minillm.SamplingParams(temperature=0.0, max_tokens=32))
"""
import hashlib
import importlib
import os
import sys
from pathlib import Path

__version__ = "0.1.0"

# Imported on first use, so that `import minillm` (and `minillm fetch`) stays instant.
_PUBLIC = {
    "LLM": "minillm.llm",
    "RequestOutput": "minillm.llm",
    "SamplingParams": "minillm.generation.sampling",
    "load_model": "minillm.model.loader",
    "fetch": "minillm.model.fetch",
}

__all__ = [*_PUBLIC, "__version__", "fingerprint"]


def fingerprint(root: str | Path | None = None) -> str:
    """12 hex digits naming the package's source: sha256 over every minillm/**/*.py (path
    relative to the package folder, then bytes, in sorted order); ``root`` another copy of that
    folder. Read from disk, importing nothing, so a notebook's version cell can show which code
    produced its outputs and a test can tell when they are stale."""
    root = Path(root) if root is not None else Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


TARGET_CACHE_PREFIX = "numba-cache-for-"


def _numba_cache_per_compile_target() -> None:
    """Point Numba's disk cache at a folder of this process's compile target, before any kernel
    module is imported (the folder for NUMBA_CPU_NAME / NUMBA_CPU_FEATURES as this process has them).

    Numba keeps one index file per function, holding an entry for every target that compiled it,
    and saves an entry by reading the index, taking the first free data-file number and writing
    both back, unlocked (numba/numba#10128). The course compiles the AVX2 path in processes of its
    own beside the host's (``NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=""``), so two processes
    could save one function at once and leave the host's key naming the AVX2 machine code.
    Measured before this folder existed: the int8 bit-identity test failed on its first run after
    ``make notebooks`` (logits equal for 10 steps, then off by 0.42) and passed alone; 75 indexes
    held entries for three targets. A NUMBA_CACHE_DIR of the user's own is the folder that the
    targets' folders go in; without one, ``minillm/__pycache__``. Setting the variable (not
    numba's config) keeps ``import minillm`` free of numba; a child process inherits it, and
    strips this process's target from it.
    """
    base = os.environ.get("NUMBA_CACHE_DIR") or str(Path(__file__).resolve().parent / "__pycache__")
    if Path(base).name.startswith(TARGET_CACHE_PREFIX):          # a parent's target folder
        base = str(Path(base).parent)
    target = os.environ.get("NUMBA_CPU_NAME") or "host"
    features = os.environ.get("NUMBA_CPU_FEATURES")
    if features is not None:                                     # "" (the named CPU's own) or "+a,-b"
        target += "-features-" + hashlib.sha256(features.encode()).hexdigest()[:8]
    folder = str(Path(base) / (TARGET_CACHE_PREFIX + target))
    os.environ["NUMBA_CACHE_DIR"] = folder
    config = sys.modules.get("numba.core.config")
    if config is not None:                                       # numba was imported first
        config.CACHE_DIR = folder


_numba_cache_per_compile_target()


def __getattr__(name):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'minillm' has no attribute {name!r}")
