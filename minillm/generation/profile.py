"""Where one decode step of the autoregressive loop spends its time, operator family by family.

``profile_decode`` runs chapter 06's loop - a prefill, then ``steps`` decode steps, each one
sampled - first plainly, for the step time a user gets, then on ``OpTimer``'s timed model (see
``minillm.model.profile``), which also times the KV-cache write and the sampler as families of
their own. What no timer saw is the Python between the ops: the instrumented step minus everything
timed, reported as ``GLUE``. Timers cost a little, so the instrumented step is a bit slower than
the plain one; both are reported.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from minillm.generation.generate import check_prompt_fits, decode_step, prefill
from minillm.generation.sampling import Sampler, SamplingParams, SamplingState
from minillm.model.profile import OpTimer
from minillm.model.transformer import Model

GLUE = "other (Python glue)"


@dataclass(frozen=True)
class DecodeProfile:
    """One decode step, taken apart. Times are per step, averaged over ``steps`` steps."""
    steps: int
    first_position: int               # the decode steps ran at first_position .. first_position + steps - 1
    step_ms_plain: float              # median of the plain runs: no timers
    step_ms_instrumented: float       # the timed run; ms_per_step sums to it
    ms_per_step: dict[str, float]     # family -> ms, GLUE included, in the order the step first meets them
    calls_per_step: dict[str, float]  # family -> calls (kernel launches, for ops)


def _run_steps(model: Model, prompt_ids: list[int], steps: int, params: SamplingParams,
               timer: OpTimer | None = None) -> float:
    """Seconds per decode step over ``steps`` steps after a prefill, sampling included.
    With a timer, the cache writes and the sampler are timed too, and the timer starts empty."""
    cache = model.new_cache(n_slots=1, max_len=len(prompt_ids) + steps)
    sampler, state = Sampler(), SamplingState(params, prompt_ids)
    sample = sampler.sample
    if timer is not None:
        cache.write = timer.wrap("kv-cache write", cache.write)
        sample = timer.wrap("sampling", sampler.sample)
    token = int(np.argmax(prefill(model, cache, prompt_ids)))  # (V,) -> the first token; prefill is not profiled
    if timer is not None:
        timer.clear()
    start = time.perf_counter()
    for position in range(len(prompt_ids), len(prompt_ids) + steps):
        logits = decode_step(model, cache, token, position)             # (V,)
        token = int(sample(logits[None], [state]).token_ids[0])        # (1, V): a batch of one
        state.output_ids.append(token)
    return (time.perf_counter() - start) / steps


def profile_decode(model: Model, prompt_ids: Sequence[int], steps: int, params: SamplingParams,
                   repeats: int = 3) -> DecodeProfile:
    """Profile ``steps`` decode steps after ``prompt_ids``: a warm-up run (every kernel compiled),
    ``repeats`` plain runs (their median), then one timed run."""
    prompt_ids = [int(t) for t in prompt_ids]
    if steps < 1 or repeats < 1:
        raise ValueError(f"steps and repeats must be >= 1, got {steps} and {repeats}")
    check_prompt_fits(len(prompt_ids), model.config.context_length)
    if len(prompt_ids) + steps > model.config.context_length:
        raise ValueError(f"{len(prompt_ids)} prompt tokens + {steps} steps exceed the model's context of "
                         f"{model.config.context_length} tokens: ask for fewer steps")
    _run_steps(model, prompt_ids, steps, params)
    plain = statistics.median(_run_steps(model, prompt_ids, steps, params) for _ in range(repeats))
    timer = OpTimer(model)
    step = _run_steps(timer.model(model), prompt_ids, steps, params, timer)
    ms = {family: 1e3 * s / steps for family, s in timer.seconds.items()}
    ms[GLUE] = 1e3 * step - sum(ms.values())
    calls = {family: n / steps for family, n in timer.calls.items()}
    return DecodeProfile(steps, len(prompt_ids), 1e3 * plain, 1e3 * step, ms, calls)
