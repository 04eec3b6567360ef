"""Compiled variants of a kernel, one per set of constants, each with a disk cache of its own.

A kernel whose loops unroll over constants (a code layout, R, T, an instruction set) is written as
a closure over them and compiled once per set (a ``functools.cache`` around the factory). Numba
keys its disk cache on the closure's constants, so each set gets its own entry - but all variants
of one closure share one index file (named module.qualname-line), whose entries are numbered as
they are saved. Two processes that compile different variants at once (two notebooks, the tests
and a server, two benchmark contenders) can both take the same number: one entry is lost, and the
one left can name the other variant's machine code - a kernel unrolled for other constants, which
reads and writes out of bounds. Measured here: a segfault in quant_fp32's T-row matvec, every run,
after a test run and a script had compiled variants side by side (a fresh cache folder ran it).
A variant named after its constants has an index of its own; processes racing on one variant
write the same bytes.
"""
from __future__ import annotations

from numba import njit


def compile_variant(kernel, **constants):
    """njit(cache=True) of ``kernel``, a closure over ``constants``, cached under its own name."""
    def spelled(value):
        return "-".join(map(str, value)) if isinstance(value, tuple) else str(value)

    kernel.__qualname__ += "_" + "_".join(f"{name}{spelled(value)}" for name, value in constants.items())
    return njit(cache=True)(kernel)
