"""minillm: an LLM inference engine built from scratch, layer by layer.

Layers (each a sub-package, importing only the layers below it):
hardware -> kernels -> model -> generation -> runtime -> serve.

    import minillm
    llm = minillm.LLM()
    llm.generate(["Once upon a time"], minillm.SamplingParams(temperature=0.0, max_tokens=32))
"""
import hashlib
import importlib
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


def __getattr__(name):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'minillm' has no attribute {name!r}")
