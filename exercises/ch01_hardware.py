"""Chapter 01 exercises: the roofline and the decode ceiling.

Two pure functions, a few lines each. They are the arithmetic behind every speed claim in this
course: how fast a kernel of a given arithmetic intensity can possibly run, and how many tokens per
second a memory-bound decode can possibly produce.

Grade your work with:

    .venv/bin/python -m pytest -m "ch01_roofline or ch01_decode_ceiling" --impl=exercises

Replace each ``raise NotImplementedError(...)`` with your code. Keep the signatures as they are.
"""
import numpy as np  # for your code

# The package objects these stubs mirror (read them after you have tried).
REFERENCE = {
    "attainable_flops": "minillm.hardware.roofline.attainable_flops",
    "decode_ceiling_tokens_per_s": "minillm.hardware.roofline.decode_ceiling_tokens_per_s",
}

# The functions each task (pytest marker) grades: course.check(marker) runs its tests.
TASKS = {
    "ch01_roofline": ["attainable_flops"],
    "ch01_decode_ceiling": ["decode_ceiling_tokens_per_s"],
}


def attainable_flops(intensity_flop_per_byte, peak_flops, bandwidth_bytes_per_s):
    """Task 1: the roofline. The best FLOP/s a kernel can reach on a machine.

    A kernel with arithmetic intensity I (FLOP per byte moved) cannot compute faster than the
    processor's peak P, and cannot compute faster than memory delivers its operands: W bytes/s
    times I FLOP per byte. So

        attainable = min(P, I * W)

    - ``intensity_flop_per_byte`` may be a Python number or a NumPy array of intensities (that is
      how the roofline plot draws a whole roof at once): use ``np.minimum`` and ``np.asarray``,
      not the built-in ``min``, and return an array (or NumPy scalar) of floats.
    - Bad input gets a clear error: raise ``ValueError`` if any intensity is negative, or if
      ``peak_flops`` or ``bandwidth_bytes_per_s`` is not > 0.

    Example: a GEMV in fp32 does 2 FLOP per 4-byte weight (I = 0.5). On a device with
    P = 1e12 FLOP/s and W = 1e11 bytes/s it reaches at most min(1e12, 0.5 * 1e11) = 5e10 FLOP/s.
    """
    raise NotImplementedError("chapter 1, task 1")


def decode_ceiling_tokens_per_s(n_params, bytes_per_weight, bandwidth_bytes_per_s, batch=1):
    """Task 2: the decode ceiling. Tokens per second if a step only had to read the weights.

    Decoding one step of an N-parameter model stored at B bytes per weight reads every weight once:
    N * B bytes. That one pass serves every sequence in the batch, producing one token each. At
    W bytes/s of memory bandwidth, a step takes at least N * B / W seconds, so

        ceiling = batch * W / (N * B)      tokens per second

    - Raise ``ValueError`` naming the argument if any of ``n_params``, ``bytes_per_weight``,
      ``bandwidth_bytes_per_s`` or ``batch`` is not > 0.

    Example: 70e9 parameters at 1 byte/weight on an H100 (W = 3.35e12 bytes/s) at batch 1:
    3.35e12 / 70e9 = 47.9 tokens/s, whatever the GPU's FLOP/s.
    """
    raise NotImplementedError("chapter 1, task 2")
