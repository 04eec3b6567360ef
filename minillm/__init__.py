"""minillm: an LLM inference engine built from scratch, layer by layer.

Layers (each a sub-package, importing only the layers below it):
hardware -> kernels -> model -> generation -> runtime -> serve.

    import minillm
    llm = minillm.LLM()
    llm.generate(["Once upon a time"], minillm.SamplingParams(temperature=0.0, max_tokens=32))
"""
import importlib

__version__ = "0.1.0"

# Imported on first use, so that `import minillm` (and `minillm fetch`) stays instant.
_PUBLIC = {
    "LLM": "minillm.llm",
    "RequestOutput": "minillm.llm",
    "SamplingParams": "minillm.generation.sampling",
    "load_model": "minillm.model.loader",
    "fetch": "minillm.model.fetch",
}

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'minillm' has no attribute {name!r}")
