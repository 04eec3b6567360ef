"""ModelConfig against transformers: its configs saved with save_pretrained, its model classes'
parameter counts, and its own GGUF loader reading a file we wrote; plus the facts of the real file."""
import json

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from minillm.model.config import ModelConfig
from minillm.model.gguf import GGUFFile, write_gguf

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=512, rms_norm_eps=1e-6)


def saved_config(hf_config, tmp_path) -> dict:
    hf_config.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("tie", [False, True])
def test_from_hf_llama_config(tmp_path, tie):
    hf = LlamaConfig(**TINY, rope_theta=50000.0, tie_word_embeddings=tie)
    c = ModelConfig.from_hf_config(saved_config(hf, tmp_path))
    assert (c.architecture, c.n_layers, c.hidden_size, c.intermediate_size) == ("llama", 3, 64, 96)
    assert (c.n_heads, c.n_kv_heads, c.head_dim) == (4, 2, 16)
    assert (c.rope_theta, c.rope_style, c.rms_eps) == (50000.0, "half", 1e-6)
    assert (c.vocab_size, c.tied_embeddings, c.qk_norm, c.context_length) == (128, tie, False, 512)


def test_from_hf_qwen3_config_with_an_explicit_head_dim(tmp_path):
    hf = Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True)  # 4 heads x 32 != 64
    c = ModelConfig.from_hf_config(saved_config(hf, tmp_path))
    assert (c.architecture, c.head_dim, c.qk_norm, c.rope_style, c.tied_embeddings) == ("qwen3", 32, True, "half", True)
    assert c.rope_theta == hf.rope_parameters["rope_theta"]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("tie", [False, True])
def test_parameter_count_matches_transformers(family, tie):
    hf_config = (LlamaConfig if family == "llama" else Qwen3Config)(**TINY, tie_word_embeddings=tie)
    model = (LlamaForCausalLM if family == "llama" else Qwen3ForCausalLM)(hf_config)
    c = ModelConfig.from_hf_config(hf_config.to_dict())
    counts = c.parameter_count()
    assert counts["total"] == model.num_parameters()  # counts a tied matrix once
    layer = model.model.layers[0]
    assert counts["per_layer"] == sum(p.numel() for p in layer.parameters())
    by_weight = c.layer_parameters()
    assert by_weight["attn_k"] == layer.self_attn.k_proj.weight.numel()
    assert by_weight["ffn_down"] == layer.mlp.down_proj.weight.numel()


def test_qwen3_0_6b_parameter_table():
    """Qwen3-0.6B's published config: ~15.7M per layer x 28 + 155.6M embedding ~ 596M."""
    hf = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                     max_position_embeddings=40960, rope_theta=1000000.0)
    with torch.device("meta"):  # shapes only, no memory
        expected = Qwen3ForCausalLM(hf).num_parameters()
    counts = ModelConfig.from_hf_config(hf.to_dict()).parameter_count()
    assert counts["total"] == expected
    assert counts["embedding"] == 151936 * 1024
    assert 15.5e6 < counts["per_layer"] < 16e6
    assert 590e6 < counts["total"] < 600e6


@pytest.mark.slow
def test_from_the_real_gguf(smollm2_path):
    gguf = GGUFFile(smollm2_path)
    c = ModelConfig.from_gguf(gguf)
    assert c == ModelConfig.from_gguf(smollm2_path)
    assert (c.architecture, c.n_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.n_heads, c.n_kv_heads, c.head_dim, c.rope_theta) == (9, 3, 64, 100000.0)
    assert (c.rope_style, c.vocab_size, c.tied_embeddings) == ("pairs", 49152, True)
    assert (c.qk_norm, c.context_length) == (False, 8192)
    assert c.rms_eps == pytest.approx(1e-5)
    assert c.parameter_count()["total"] == sum(t.n_elements for t in gguf.tensors.values())  # the file's own count


def llama_gguf_metadata(arch: str = "llama", **extra) -> dict:
    """Metadata as llama.cpp's converter writes it, with a 4-token vocabulary."""
    return {
        "general.architecture": arch, "general.name": "tiny",
        f"{arch}.block_count": 2, f"{arch}.context_length": 256, f"{arch}.embedding_length": 64,
        f"{arch}.feed_forward_length": 96, f"{arch}.attention.head_count": 4, f"{arch}.attention.head_count_kv": 2,
        f"{arch}.rope.freq_base": 10000.0, f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "c", "d"],
        "tokenizer.ggml.token_type": [1, 1, 1, 1], "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1, **extra,
    }


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("untied", [False, True])
def test_a_gguf_we_write_reads_the_same_in_transformers(tmp_path, arch, untied):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    extra = {f"{arch}.attention.key_length": 32, f"{arch}.attention.value_length": 32} if arch == "qwen3" else {}
    tensors = {"token_embd.weight": np.zeros((4, 64), np.float32)}
    if untied:
        tensors["output.weight"] = np.zeros((4, 64), np.float32)
    path = write_gguf(tmp_path / "tiny.gguf", llama_gguf_metadata(arch, **extra), tensors)
    hf = load_gguf_checkpoint(str(path))["config"]
    ours = ModelConfig.from_gguf(path)
    assert (ours.n_layers, ours.hidden_size, ours.intermediate_size) == (
        hf["num_hidden_layers"], hf["hidden_size"], hf["intermediate_size"])
    assert (ours.n_heads, ours.n_kv_heads, ours.context_length) == (
        hf["num_attention_heads"], hf["num_key_value_heads"], hf["max_position_embeddings"])
    assert ours.tied_embeddings == hf["tie_word_embeddings"] == (not untied)
    assert ours.rms_eps == pytest.approx(hf["rms_norm_eps"]) and ours.vocab_size == 4
    assert ours.head_dim == (32 if arch == "qwen3" else 16)
    assert ours.rope_style == ("pairs" if arch == "llama" else "half")


def test_unsupported_models_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma2'"):
        ModelConfig.from_gguf_metadata({"general.architecture": "gemma2"}, [])
    with pytest.raises(ValueError, match="unsupported Hugging Face model_type 'gpt2'"):
        ModelConfig.from_hf_config({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="lacks 'llama.block_count'"):
        meta = llama_gguf_metadata()
        del meta["llama.block_count"]
        ModelConfig.from_gguf_metadata(meta, [])
    with pytest.raises(ValueError, match=r"RoPE scaling \(rope_freqs.weight\) is not supported"):
        ModelConfig.from_gguf_metadata(llama_gguf_metadata(), ["rope_freqs.weight"])
    scaled = LlamaConfig(**TINY, rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match=r"RoPE scaling \(linear\) is not supported"):
        ModelConfig.from_hf_config(saved_config(scaled, tmp_path))
    with pytest.raises(ValueError, match="attention_bias = true is not supported"):
        ModelConfig.from_hf_config(saved_config(LlamaConfig(**TINY, attention_bias=True), tmp_path))
    with pytest.raises(ValueError, match="cannot be shared evenly"):
        ModelConfig.from_hf_config(saved_config(LlamaConfig(**{**TINY, "num_key_value_heads": 3}), tmp_path))
