"""Capacity = weights + KV state + workspace, checked against transformers and published facts.

The oracles: a tiny random transformers Llama (its parameter count, the bytes of its KV cache after
a forward), the `gguf` package reading the real SmolLM2 file, the parameter counts published for
Llama-2-70B and Llama-3-70B, and arithmetic written out from the definitions.
"""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm.hardware import capacity as cap
from minillm.hardware.capacity import LLAMA2_70B, LLAMA3_70B, ModelShape

# head_dim 16 is not hidden / heads (48 / 6 = 8): the formulas must use head_dim, not derive it.
TINY = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, head_dim=16)


def tiny_shape(tie: bool) -> ModelShape:
    return ModelShape("tiny", n_layers=2, hidden_size=48, intermediate_size=80, n_heads=6, n_kv_heads=2,
                      head_dim=16, vocab_size=96, tied_embeddings=tie)


@pytest.mark.parametrize("tie", [False, True])
def test_parameter_count_matches_transformers(tie):
    model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=tie))
    assert tiny_shape(tie).n_params == sum(p.numel() for p in model.parameters())   # tied: counted once


@pytest.mark.parametrize("dtype, nbytes", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_kv_bytes_match_a_transformers_cache(dtype, nbytes):
    batch, context = 3, 7
    model = LlamaForCausalLM(LlamaConfig(**TINY)).to(dtype)
    with torch.no_grad():
        cache = model(torch.zeros(batch, context, dtype=torch.long), use_cache=True).past_key_values
    cached = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert cap.capacity(tiny_shape(False), 2.0, batch, context, kv_dtype_bytes=nbytes).kv_bytes == cached


@pytest.mark.slow
def test_smollm2_shape_from_its_config_counts_the_file_s_parameters(smollm2_path):
    from gguf import GGUFReader

    from minillm.model.config import ModelConfig

    shape = ModelShape.like(ModelConfig.from_gguf(smollm2_path), "SmolLM2-135M")
    assert shape.n_params == sum(int(t.n_elements) for t in GGUFReader(smollm2_path).tensors) == 134_515_008
    # Q4_1 blocks of 32 weights in 20 bytes; the embedding table (the tied LM head) Q8_0, 34 bytes per 32.
    assert cap.weights_bytes(shape, 20 / 32, 34 / 32) == pytest.approx(96.47e6, rel=1e-3)


def test_published_70b_parameter_counts():
    assert LLAMA2_70B.n_params == 68_976_648_192              # Llama-2-70b-hf, as its model card tools count it
    assert 2 * LLAMA3_70B.n_params == 141_107_412_992         # Meta-Llama-3-70B: BF16 total_size in its
    #                                                            model.safetensors.index.json


def test_70b_kv_per_token_and_what_gqa_saves():
    assert LLAMA2_70B.kv_bytes_per_token(2) == 2 * 80 * 8 * 128 * 2 == 327_680   # K and V, 80 layers, 8 KV heads
    assert LLAMA3_70B.kv_bytes_per_token(2) == LLAMA2_70B.kv_bytes_per_token(2)  # the same attention blocks
    mha = ModelShape("70B with MHA", 80, 8192, 28672, 64, 64, 128, 32000, False)
    assert mha.kv_bytes_per_token(2) == 8 * LLAMA2_70B.kv_bytes_per_token(2)     # 64 KV heads instead of 8


def test_70b_in_bf16_needs_two_80gb_cards_and_8_bit_fits_one():
    bf16 = cap.weights_bytes(LLAMA3_70B, 2.0)
    assert bf16 == 141_107_412_992 and 80e9 < bf16 <= 2 * 80e9
    # 8-bit weights in groups of 128 with an FP16 scale (1 + 2/128 bytes each) in the blocks; the
    # embedding table, LM head and norms kept in BF16.
    per_layer = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672          # q, o; k, v; gate, up, down
    others = 2 * 128256 * 8192 + (2 * 80 + 1) * 8192
    eight_bit = cap.weights_bytes(LLAMA3_70B, 1 + 2 / 128, other_bytes_per_weight=2.0)
    assert eight_bit == pytest.approx(80 * per_layer * (1 + 2 / 128) + 2 * others)
    assert round(eight_bit / 1e9, 2) == 73.73 and eight_bit < 80e9


def test_kv_crossover_is_where_kv_weighs_as_much_as_the_weights():
    tokens = cap.kv_crossover_tokens(LLAMA3_70B, 2.0, 2.0)
    assert tokens == pytest.approx(141_107_412_992 / 327_680)                  # ~430k tokens of context
    at = cap.capacity(LLAMA3_70B, 2.0, batch=1, context=round(tokens), kv_dtype_bytes=2.0)
    assert at.kv_bytes == pytest.approx(at.weights_bytes, rel=1e-5)
    # with FP32 K/V (SmolLM2 on a CPU here) the crossover comes after half as many tokens
    assert cap.kv_crossover_tokens(LLAMA3_70B, 2.0, 4.0) == pytest.approx(tokens / 2)


def test_workspace_is_the_widest_activations_plus_fp32_logits():
    shape = tiny_shape(False)
    # 3 x D residual, normed copy and output; the MLP's gate and up (2 x 80) beat q, k, v, o ((12 + 4) x 16)
    per_token = (3 * 48 + max((2 * 6 + 2 * 2) * 16, 2 * 80)) * 2
    assert cap.workspace_bytes(shape, batch=5, activation_bytes=2) == 5 * (per_token + 96 * 4)
    assert cap.capacity(shape, 1.0, 5, 0, 2.0).workspace_bytes == 5 * (per_token + 96 * 4)


def test_capacity_total_and_fit():
    c = cap.capacity(tiny_shape(True), bytes_per_weight=2.0, batch=4, context=10, kv_dtype_bytes=2.0)
    assert c.weights_bytes == 2 * tiny_shape(True).n_params
    assert c.kv_bytes == 4 * 10 * (2 * 2 * 2 * 16 * 2)
    assert c.total_bytes == c.weights_bytes + c.kv_bytes + c.workspace_bytes
    assert c.fits(c.total_bytes) and not c.fits(c.total_bytes - 1)


def test_max_kv_tokens_fill_the_card_exactly():
    card, batch = 80e9, 64
    tokens = cap.max_kv_tokens(LLAMA3_70B, card, 1 + 2 / 128, 2.0, batch, other_bytes_per_weight=2.0)
    fixed = cap.weights_bytes(LLAMA3_70B, 1 + 2 / 128, 2.0) + cap.workspace_bytes(LLAMA3_70B, batch, 2.0)
    assert tokens == int((card - fixed) // 327_680)
    assert fixed + tokens * 327_680 <= card < fixed + (tokens + 1) * 327_680
    assert cap.max_kv_tokens(LLAMA3_70B, card, 2.0, 2.0, batch) == 0          # BF16 weights alone overflow


def test_bad_shapes_and_arguments_are_refused():
    with pytest.raises(ValueError, match="n_kv_heads|KV heads"):
        ModelShape("x", 2, 48, 80, 6, 4, 16, 96, False)
    with pytest.raises(ValueError, match="head_dim"):
        ModelShape("x", 2, 48, 80, 6, 2, 0, 96, False)
    with pytest.raises(ValueError, match="context"):
        cap.capacity(tiny_shape(False), 1.0, 1, -1, 2.0)
    with pytest.raises(ValueError, match="batch"):
        cap.capacity(tiny_shape(False), 1.0, 0, 8, 2.0)
    with pytest.raises(ValueError, match="kv_dtype_bytes"):
        tiny_shape(False).kv_bytes_per_token(0)
    with pytest.raises(ValueError, match="bytes_per_weight"):
        cap.weights_bytes(tiny_shape(False), -1.0)
