"""Constrained generation on the real model: greedy outputs parse and validate (jsonschema), any
mix of constrained and free sequences shares a step, and jump-forward saves forwards."""
import json
import re

import jsonschema
import pytest

from minillm.generation.constrained.examples import PROMPTS, SCHEMAS
from minillm.generation.sampling import SamplingParams
from minillm.llm import LLM

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path)


def chat(llm, name):
    return llm.chat_prompt([{"role": "user", "content": PROMPTS[name]}])


def count_forwards(llm, fn):
    steps = []
    stop = llm.engine.observe(lambda plan, outputs: steps.append(plan))
    try:
        return fn(), len(steps)
    finally:
        stop()


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_greedy_json_validates(llm, name):
    params = SamplingParams(temperature=0, max_tokens=200, guided_json=SCHEMAS[name])
    out = llm.generate([chat(llm, name)], params, use_tqdm=False)[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), SCHEMAS[name])


def test_constrained_and_free_sequences_share_a_step(llm):
    free = SamplingParams(temperature=0, max_tokens=12)
    alone = llm.generate(["The capital of France is"], free, use_tqdm=False)[0]
    prompts = ["The capital of France is", "Is the sky blue? Answer:", "A date: "]
    params = [free, SamplingParams(temperature=0, guided_choice=["yes", "no"]),
              SamplingParams(temperature=0.9, seed=3, max_tokens=20, guided_regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}")]
    ids = [llm.engine.add_request(llm.tokenizer.encode(p), q) for p, q in zip(prompts, params)]
    while llm.engine.has_unfinished():
        llm.engine.step()
    outs = [llm.engine.pop_request(i).outputs[0] for i in ids]
    assert outs[0].text == alone.text                 # the free sequence is untouched by its neighbours' masks
    assert outs[1].text in ("yes", "no")
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", outs[2].text)


def test_jump_forward_saves_forwards(llm):
    params = SamplingParams(temperature=0, max_tokens=200, guided_json=SCHEMAS["person"])
    prompt = chat(llm, "person")
    try:
        llm.engine.jump_forward = False
        slow, slow_steps = count_forwards(llm, lambda: llm.generate([prompt], params, use_tqdm=False)[0])
        llm.engine.jump_forward = True
        fast, fast_steps = count_forwards(llm, lambda: llm.generate([prompt], params, use_tqdm=False)[0])
    finally:
        llm.engine.jump_forward = True
    for out in (slow, fast):
        jsonschema.validate(json.loads(out.text), SCHEMAS["person"])
    assert fast_steps < slow_steps
    assert len(fast.token_ids) / fast_steps > 1.0


def test_bad_constraints_are_refused_by_name():
    with pytest.raises(ValueError, match="guided_json is not supported: not at \\$.properties.a is not supported"):
        SamplingParams(guided_json={"type": "object", "properties": {"a": {"not": {"additionalProperties": False}}}})
    with pytest.raises(ValueError, match="guided_regex is not supported: .*lazy"):
        SamplingParams(guided_regex="a+?")
    with pytest.raises(ValueError, match="only one constraint"):
        SamplingParams(guided_regex="a", guided_choice=["a"])
