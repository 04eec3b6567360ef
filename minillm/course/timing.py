"""Timing a learner's kernel against the package's, on SmolLM2-135M's shapes. Reported and
recorded, never asserted: timings belong to the learner's machine and moment."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from minillm.course import ledger
from minillm.course.grading import passes
from minillm.course.tasks import solutions, task

# SmolLM2-135M: hidden D, feed-forward F, query/KV heads of head_dim, vocabulary; a 512-token
# context and a 64-token prefill chunk stand for "a typical step".
D, F, H, HKV, DH, VOCAB, CONTEXT, CHUNK, BLOCK = 576, 1536, 9, 3, 64, 49152, 512, 64, 16


def _inputs() -> dict[str, Callable[[], tuple]]:
    """task -> a function making fresh arguments for one call (fresh: some kernels work in place)."""
    from minillm.kernels import reference
    from minillm.kernels.cpu import quant

    rng = np.random.default_rng(0)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    x, w = f32(CHUNK, D), f32(D)
    scores, logits = f32(H, CONTEXT), f32(4, VOCAB)
    q, positions = f32(CHUNK, H, DH), np.arange(CHUNK)
    cos, sin = reference.rope_table(DH, CONTEXT, 100000.0)
    a, b = f32(CHUNK, D), f32(D, F)
    q1, k, v = f32(H, DH), f32(CONTEXT, HKV, DH), f32(CONTEXT, HKV, DH)
    qm, row = quant.quantize(f32(F, D), "Q4_1"), f32(D)
    n_blocks = 4 * CONTEXT // BLOCK
    kc, vc = f32(n_blocks, BLOCK, HKV, DH), f32(n_blocks, BLOCK, HKV, DH)
    tables = rng.permutation(n_blocks).reshape(4, -1)  # 4 sequences of CONTEXT tokens, blocks scattered
    qb, lens = f32(4, H, DH), np.full(4, CONTEXT)
    tokens = rng.integers(0, VOCAB, BLOCK).tolist()
    return {
        "ch02_rmsnorm": lambda: (x, w, 1e-5),
        "ch02_softmax": lambda: (scores,),
        "ch02_rope": lambda: (q.copy(), positions, cos, sin, "pairs"),
        "ch02_tiled_matmul": lambda: (a, b),
        "ch02_decode_attention": lambda: (q1, k, v, CONTEXT),
        "ch04_q4_1_dequantize": lambda: (qm.data, F, D),
        "ch04_quant_matvec": lambda: (row, qm),
        "ch06_top_p": lambda: (logits, 0.9),
        "ch07_slot_mapping": lambda: (tables[0], np.arange(CONTEXT), BLOCK),
        "ch07_block_hash": lambda: (tokens, None),
        "ch07_paged_attention": lambda: (qb, kc, vc, tables, lens),
    }


def _median_seconds(fns: dict[str, Callable], make_args: Callable[[], tuple], repeats: int = 7) -> dict[str, float]:
    """Median seconds per call of each fn, measured in turns (A, B, A, B ...) so that a busy
    moment of a shared machine hits both alike; each is called once first (Numba compiles then)."""
    for fn in fns.values():
        fn(*make_args())
    start = time.perf_counter()
    next(iter(fns.values()))(*make_args())
    calls = max(1, int(0.02 / max(time.perf_counter() - start, 1e-7)))  # ~20 ms per sample
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            args = [make_args() for _ in range(calls)]
            start = time.perf_counter()
            for a in args:
                fn(*a)
            samples[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(s) for name, s in samples.items()}


@dataclass(frozen=True)
class Timing:
    marker: str
    your_s: float     # median seconds per call of the learner's version
    package_s: float  # and of the package's

    @property
    def ratio(self) -> float:
        return self.your_s / self.package_s

    def __repr__(self) -> str:  # one line: a notebook cell ending with time_exercise(...) echoes it
        return f"Timing({self.marker}: yours takes {self.ratio:.2f}x the package's time)"


def time_exercise(marker: str) -> Timing | None:
    """If the learner's version of the task passes its tests, time it against the package's on
    SmolLM2's shapes, print the ratio and record it in the ledger; otherwise say why not."""
    timed = _inputs()
    if marker not in timed:
        task(marker)  # an unknown marker fails here, by name
        print(f"{marker}: there is no timing for this task; the timed tasks are {', '.join(timed)}")
        return None
    passed, graded_by = passes(marker)
    if not passed:
        print(f"{marker}: your version does not pass its tests yet ({graded_by}; course.check({marker!r}) "
              "says which), so there is nothing to time")
        return None
    module, names = task(marker)
    (name, package_fn), = solutions(marker).items()
    seconds = _median_seconds({"yours": getattr(module, name), "package": package_fn}, timed[marker])
    result = Timing(marker, seconds["yours"], seconds["package"])
    print(f"{marker}: yours {result.your_s * 1e3:.3f} ms, the package's {result.package_s * 1e3:.3f} ms "
          f"per call -> yours takes {result.ratio:.2f}x the package's time (median of 7, taken in turns; "
          f"passing by {graded_by})")
    ledger.record(marker, your_s=result.your_s, package_s=result.package_s, ratio=result.ratio)
    return result
