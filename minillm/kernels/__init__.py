"""Layer 2: operators. Three backends expose the same set (registry.OPS), one module each:

    reference.py      the specification in NumPy: every operator, quantized and paged ones included
    cpu/              the Numba CPU backend (cpu/__init__.py), its kernels one idea per file
    cuda/             the Numba CUDA backend (cuda/__init__.py), likewise
    registry.py       a backend by name ("reference", "numba", "cuda", or one registered from above,
                      like the course's "exercises"), checked complete

and what they share: shapes.py (argument checks), quant_formats.py (the GGUF block formats) and
quant_kv.py (int8 K/V rounding, for chapter 04's quality measurement). Every backend owns its
K/V writes (write_kv), so that a GPU backend can keep the paged cache on its device.
"""
