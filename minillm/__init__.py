"""minillm: an LLM inference engine built from scratch, layer by layer.

Layers (each a sub-package, importing only the layers below it):
hardware -> kernels -> model -> generation -> runtime -> serve.
"""
from minillm.model.fetch import fetch

__version__ = "0.1.0"

__all__ = ["fetch", "__version__"]
