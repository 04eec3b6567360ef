"""A request's time to first token in three parts - queue, prefill, first sample - from the instants
the engine records, checked against the steps an observer saw end (the step is the oracle: the
prefill must end inside the step that produced the first token, not a step earlier or later)."""
import time

import pytest

from minillm.generation.sampling import SamplingParams
from minillm.llm import load_tokenizer
from minillm.model.loader import load_model
from minillm.runtime.engine import LLMEngine


@pytest.mark.slow
def test_queue_prefill_and_first_sample_fall_in_the_right_steps(smollm2_path):
    engine = LLMEngine(load_model(smollm2_path), load_tokenizer(smollm2_path),
                       max_num_seqs=1, max_num_batched_tokens=16)  # one at a time; a 40-token prompt takes 3 steps
    ends, first_token_step = [], {}

    def on_step(plan, outputs):
        ends.append(time.perf_counter())
        for out in outputs:
            if out.first_token:
                first_token_step[out.request_id] = len(ends) - 1

    engine.observe(on_step)
    prompt = load_tokenizer(smollm2_path).encode("The quick brown fox jumps over the lazy dog. " * 5)[:40]
    ids = [engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
           for _ in range(2)]
    while engine.has_unfinished():
        engine.step()
    times = {i: engine.pop_request(i).times[0] for i in ids}

    for request_id, t in times.items():
        assert t.arrival <= t.first_scheduled <= t.prefill_done <= t.first_token
        step = first_token_step[request_id]
        assert ends[step - 1] < t.prefill_done <= ends[step]    # the forward of the step that made token 1
        assert t.first_token <= ends[step]
    first, second = times[ids[0]], times[ids[1]]
    assert first_token_step[ids[0]] == 2                       # ceil(40 / 16) prefill steps
    assert second.first_scheduled >= first.finished            # it queued while the first one ran
    assert second.first_scheduled - second.arrival > first.first_token - first.arrival  # its queue was the longer
