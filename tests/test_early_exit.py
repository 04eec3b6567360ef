"""Early exit (the self-speculative draft): ``Model.forward(..., num_layers=L)`` against transformers.

The oracle: transformers' hidden state after L layers (``output_hidden_states``), through the
final norm and the LM head. The cache the short forward fills must hold exactly what the full
forward writes into those L layers - the verify forward overwrites the draft's slots with it.
"""
import numpy as np
import pytest
import torch

from minillm.model.kv_cache import AttentionMetadata
from minillm.model.loader import load_model
from tests.test_transformer import ATOL, RTOL, prompts, tiny_hf_model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = tiny_hf_model("llama", tied=False, seed=3)
    path = tmp_path_factory.mktemp("early-exit")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, load_model(path)


def batch(seqs):
    return AttentionMetadata(query_lens=[len(s) for s in seqs], context_lens=[0] * len(seqs),
                             seq_slots=list(range(len(seqs))), logits_indices=np.arange(sum(map(len, seqs))))


def test_first_layer_then_norm_and_head_match_transformers(pair):
    hf, model = pair
    seqs = prompts([5, 3], seed=4)
    logits = model.forward(np.concatenate(seqs), batch(seqs), model.new_cache(2, 8), num_layers=1)  # (8, V)
    for b, seq in enumerate(seqs):
        with torch.no_grad():
            hidden = hf(torch.tensor([seq.tolist()]), output_hidden_states=True).hidden_states[1]  # (1, T, D)
            want = hf.lm_head(hf.model.norm(hidden))[0].numpy()                                    # (T, V)
        rows = logits[batch(seqs).query_starts[b]:batch(seqs).query_starts[b + 1]]
        np.testing.assert_allclose(rows, want, rtol=RTOL, atol=ATOL, err_msg=f"sequence {b}")


def test_early_exit_writes_the_full_forwards_kv_for_its_layers(pair):
    _, model = pair
    seqs = prompts([6], seed=5)
    short, full = model.new_cache(1, 8), model.new_cache(1, 8)
    model.forward(seqs[0], batch(seqs), short, num_layers=1)
    all_layers = model.forward(seqs[0], batch(seqs), full)
    np.testing.assert_array_equal(short.k[0], full.k[0])
    np.testing.assert_array_equal(short.v[0], full.v[0])
    assert not short.k[1].any()                                       # the layer it skipped is untouched
    np.testing.assert_array_equal(model.forward(seqs[0], batch(seqs), model.new_cache(1, 8),
                                                num_layers=model.config.n_layers), all_layers)


@pytest.mark.parametrize("bad", [0, 3, -1])
def test_a_depth_outside_the_model_is_named(pair, bad):
    _, model = pair
    seqs = prompts([2])
    with pytest.raises(ValueError, match=r"num_layers must lie in \[1, 2\]"):
        model.forward(seqs[0], batch(seqs), model.new_cache(1, 8), num_layers=bad)
