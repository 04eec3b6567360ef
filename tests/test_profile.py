"""The decode profiler: its timers change no result, put every kernel call in the right family, and
its byte count per family is the file's (the ``gguf`` package as the oracle). How fast a step is
belongs to benchmarks/decode_profile.py, not here."""
import time

import numpy as np
import pytest
from gguf import GGUFReader
from test_transformer import LAYERS, prompts, tiny_hf_model, write_tiny_llama_gguf

from minillm.generation.generate import decode_step, prefill
from minillm.generation.profile import GLUE, profile_decode
from minillm.generation.sampling import SamplingParams
from minillm.model.loader import load_model
from minillm.model.profile import WEIGHT_FAMILIES, OpTimer, weight_bytes_by_family

PARAMS = SamplingParams(temperature=0.8, top_p=0.95, seed=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(a tiny untied Llama with Q8_0 weights, its GGUF file)."""
    path = tmp_path_factory.mktemp("profile") / "tiny.gguf"
    write_tiny_llama_gguf(tiny_hf_model("llama", tied=False, seed=7), path, "Q8_0", "Q8_0")
    return load_model(path), path


def logits_of(model, ids) -> np.ndarray:
    """The logits of a prefill and of two greedy decode steps after it -> (3, V)."""
    cache = model.new_cache(1, len(ids) + 2)
    rows = [prefill(model, cache, ids)]
    for position in (len(ids), len(ids) + 1):
        rows.append(decode_step(model, cache, int(np.argmax(rows[-1])), position))
    return np.stack(rows)


def test_the_timed_model_computes_exactly_what_the_model_computes(tiny):
    model, _ = tiny
    ids = prompts([9], seed=3)[0]
    np.testing.assert_array_equal(logits_of(OpTimer(model).model(model), ids), logits_of(model, ids))


def test_one_decode_step_calls_each_family_as_the_architecture_says(tiny):
    model, _ = tiny
    timer = OpTimer(model)
    timed = timer.model(model)
    cache = timed.new_cache(1, 8)
    prefill(timed, cache, [1, 2, 3])
    timer.clear()
    decode_step(timed, cache, 4, 3)
    # per layer: 2 norms, one stacked QKV matvec, one RoPE over q and k, one attention, the output
    # projection, one stacked gate/up matvec, SwiGLU, the down projection; then the final norm and the head
    per_layer = ["qkv proj", "rope", "attention", "attn output proj", "ffn gate/up", "swiglu", "ffn down"]
    expected = {"embedding": 1, "rms_norm": 2 * LAYERS + 1, "LM head": 1} | dict.fromkeys(per_layer, LAYERS)
    assert dict(timer.calls) == expected
    assert set(timer.seconds) == set(expected) and all(s > 0 for s in timer.seconds.values())


def test_the_timer_accumulates_seconds_and_calls(tiny):
    timer = OpTimer(tiny[0])
    nap = timer.wrap("nap", time.sleep)
    nap(0.02)
    nap(0.01)
    assert timer.calls["nap"] == 2 and timer.seconds["nap"] >= 0.03


def test_weight_bytes_per_family_are_the_files_tensor_bytes(tiny):
    model, path = tiny
    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    names = {"qkv proj": ("attn_q", "attn_k", "attn_v"), "attn output proj": ("attn_output",),
             "ffn gate/up": ("ffn_gate", "ffn_up"), "ffn down": ("ffn_down",)}
    expected = {family: sum(tensors[f"blk.{i}.{n}.weight"] for i in range(LAYERS) for n in parts)
                for family, parts in names.items()} | {"LM head": tensors["output.weight"]}
    assert weight_bytes_by_family(model) == expected and set(expected) == set(WEIGHT_FAMILIES)


def test_profile_decode_accounts_for_the_whole_step(tiny):
    model, _ = tiny
    p = profile_decode(model, [5, 6, 7, 8], steps=4, params=PARAMS, repeats=1)
    assert (p.steps, p.first_position) == (4, 4)
    assert sum(p.ms_per_step.values()) == pytest.approx(p.step_ms_instrumented)
    assert p.calls_per_step["sampling"] == 1 and p.calls_per_step["kv-cache write"] == LAYERS
    assert p.calls_per_step["LM head"] == 1 and GLUE in p.ms_per_step and GLUE not in p.calls_per_step
    assert p.step_ms_plain > 0


@pytest.mark.parametrize("prompt, steps, words", [([], 4, "empty"), ([1, 2], 0, "steps"),
                                                  ([1] * 60, 10, "context")])
def test_profile_decode_refuses_a_workload_that_cannot_run(tiny, prompt, steps, words):
    with pytest.raises(ValueError, match=words):
        profile_decode(tiny[0], prompt, steps, PARAMS)
