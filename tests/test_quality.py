"""minillm.model.quality against oracles: its measures against PyTorch's definitions, and the
models it compares (weights in other formats, int8 K/V) against transformers reading GGUF files
written by the gguf package, with K/V rounded by PyTorch's quantizer."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from transformers import AutoModelForCausalLM, DynamicCache

from minillm.kernels.cpu.quant import QMatrix
from minillm.model.config import ModelConfig
from minillm.model.gguf import GGUFFile, write_gguf
from minillm.model.kv_cache import AttentionMetadata, ContiguousKVCache
from minillm.model.loader import load_gguf_weights
from minillm.model.quality import (
    Int8KVCache, agreement, decode_logits, held_out_text, kv_bytes_per_token, perplexity, prefill_logits, variant_logits,
    variant_model, weights_in_format,
)
from minillm.runtime.paged_cache import bytes_per_token
from test_transformer import ATOL, RTOL, hf_logits, prompts, tiny_hf_model, write_tiny_llama_gguf


def logits(seed, T=7, V=50, scale=3.0):
    return (np.random.default_rng(seed).standard_normal((T, V)) * scale).astype(np.float32)


def test_perplexity_is_exp_of_torch_cross_entropy():
    x, ids = logits(0), np.random.default_rng(1).integers(0, 50, 7)
    want = torch.exp(F.cross_entropy(torch.tensor(x[:-1], dtype=torch.float64), torch.tensor(ids[1:]))).item()
    assert perplexity(x, ids) == pytest.approx(want, rel=1e-9)


def test_kl_and_top1_match_torch():
    p, q = logits(2), logits(3)
    q[:3] = p[:3] + 0.01  # three positions nearly equal: same argmax
    want = F.kl_div(torch.log_softmax(torch.tensor(q, dtype=torch.float64), -1),
                    torch.log_softmax(torch.tensor(p, dtype=torch.float64), -1),
                    log_target=True, reduction="none").sum(-1).numpy()
    got = agreement(p, q)
    assert got.mean_kl == pytest.approx(want.mean(), rel=1e-9)
    assert got.max_kl == pytest.approx(want.max(), rel=1e-9)
    assert got.top1 == pytest.approx((p.argmax(-1) == q.argmax(-1)).mean())
    assert agreement(p, p).mean_kl == pytest.approx(0.0, abs=1e-12)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="shapes differ"):
        agreement(logits(0), logits(0, T=6))
    with pytest.raises(ValueError, match="one logits row per token"):
        perplexity(logits(0), [1, 2])


# -----------------------------------------------------------------------------
# the variants, on a tiny Llama written to GGUF as SmolLM2's file is (Q4_1 layers, tied Q8_0
# embedding), against transformers reading GGUF files (dequantized by the gguf package)

@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    """A tiny Llama as a GGUF file in SmolLM2's formats, and a sequence of token ids."""
    path = tmp_path_factory.mktemp("quality") / "tiny.gguf"
    write_tiny_llama_gguf(tiny_hf_model("llama", tied=True, seed=3), path, "Q4_1", "Q8_0")
    return path, prompts([12], seed=4)[0]


def oracle(path):
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def requantized_by_gguf(src, dst, qtype):
    """src's linear layers re-quantized to qtype by the gguf package (llama.cpp's own Python code)."""
    g = GGUFFile(src)
    tensors = {}
    for name in g.tensors:
        t = g.tensor(name)
        if isinstance(t, QMatrix) and name != "token_embd.weight":
            values = gguf_quants.dequantize(t.data, GGMLQuantizationType[t.qtype])           # (rows, cols)
            t = QMatrix(qtype, t.shape, gguf_quants.quantize(values, GGMLQuantizationType[qtype]))
        tensors[name] = t
    write_gguf(dst, g.metadata, tensors)
    return dst


def test_fp32_variant_is_the_files_weights_dequantized(tiny_file):
    path, ids = tiny_file
    config, packed = load_gguf_weights(path)
    fp32 = weights_in_format(packed, "fp32")
    g = GGUFFile(path)
    for name, w in [("blk.1.ffn_down.weight", fp32.layers[1].w_down), ("token_embd.weight", fp32.embedding)]:
        t = g.tensor(name)
        np.testing.assert_array_equal(w, gguf_quants.dequantize(t.data, GGMLQuantizationType[t.qtype]), err_msg=name)
    assert fp32.lm_head is fp32.embedding  # tied: one fp32 copy
    [logits] = variant_logits(path, "fp32", [ids])
    np.testing.assert_allclose(logits, hf_logits(oracle(path), ids), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_requantized_variant_matches_transformers_on_gguf_requantized_weights(tiny_file, tmp_path, qtype):
    path, ids = tiny_file
    [logits] = variant_logits(path, qtype, [ids])
    expected = hf_logits(oracle(requantized_by_gguf(path, tmp_path / f"{qtype}.gguf", qtype)), ids)
    np.testing.assert_allclose(logits, expected, rtol=RTOL, atol=ATOL)
    model = variant_model(path, qtype)
    assert model.weights.layers[0].w_up.qtype == qtype and model.weights.embedding.qtype == "Q8_0"


def test_prefill_and_decode_feeds_give_the_same_logits(tiny_file):
    path, ids = tiny_file
    model = variant_model(path, "Q4_1")
    expected = hf_logits(oracle(path), ids)
    for feed in (prefill_logits, decode_logits):
        np.testing.assert_allclose(feed(model, ids, model.new_cache(1, len(ids))), expected, rtol=RTOL, atol=ATOL)


class Int8Cache(DynamicCache):
    """transformers' cache with K and V fake-quantized by PyTorch, per (batch, head, token) vector."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(self.int8(key_states), self.int8(value_states), layer_idx, *args, **kwargs)

    @staticmethod
    def int8(x):                                          # (B, Hkv, T, Dh)
        flat = x.reshape(-1, x.shape[-1])                 # (vectors, Dh)
        scale = flat.abs().amax(-1) / 127
        zeros = torch.zeros(len(scale), dtype=torch.int32)
        return torch.fake_quantize_per_channel_affine(flat, scale, zeros, 0, -127, 127).reshape(x.shape)


def test_int8_kv_variant_matches_transformers_with_an_int8_cache(tiny_file):
    """Our int8 KV, in one prefill and token by token, against transformers attending over
    PyTorch-quantized K/V (the order of a head's dimensions differs - GGUF's Q/K rows are
    permuted - but a per-vector scale and element-wise rounding do not care)."""
    path, ids = tiny_file
    hf = oracle(path)
    with torch.no_grad():
        expected = hf(torch.tensor([list(ids)]), cache=Int8Cache(), use_cache=True).logits[0].numpy()
    [logits] = variant_logits(path, "int8 KV", [ids])
    np.testing.assert_allclose(logits, expected, rtol=RTOL, atol=ATOL)
    model = variant_model(path, "int8 KV")
    np.testing.assert_allclose(decode_logits(model, ids, Int8KVCache(model.config, 1, len(ids))), expected,
                               rtol=RTOL, atol=ATOL)
    assert np.abs(expected - hf_logits(hf, ids)).max() > 100 * ATOL  # the rounding is visible at this tolerance


def test_int8_kv_cache_stores_the_round_trip(tiny_file):
    config = ModelConfig.from_gguf(GGUFFile(tiny_file[0]))
    rng = np.random.default_rng(5)
    k, v = (rng.standard_normal((2, 5, config.n_kv_heads, config.head_dim)) * 3).astype(np.float32)  # (T, Hkv, Dh)
    cache = Int8KVCache(config, 2, 8)
    cache.write(1, k, v, AttentionMetadata(query_lens=[5], context_lens=[2], seq_slots=[1]))
    for stored, x in [(cache.k[1, 1, 2:7], k), (cache.v[1, 1, 2:7], v)]:
        np.testing.assert_array_equal(stored, Int8Cache.int8(torch.tensor(x)).numpy())
    assert not cache.k[1, 1, :2].any() and not cache.k[0].any()  # nothing else written
    assert isinstance(cache, ContiguousKVCache)  # the engine's cache class is left as it is


def test_kv_bytes_per_token_against_the_runtimes_fp32_figure(tiny_file):
    config = ModelConfig.from_gguf(GGUFFile(tiny_file[0]))
    assert kv_bytes_per_token(config, "fp32") == bytes_per_token(config)
    assert kv_bytes_per_token(config, "int8") == 2 * config.n_layers * config.n_kv_heads * (config.head_dim + 4)


def test_unknown_variants_and_formats_are_named(tiny_file):
    with pytest.raises(ValueError, match="unknown variant 'Q2_K'"):
        variant_model(tiny_file[0], "Q2_K")
    with pytest.raises(ValueError, match="unknown weight format 'int8'"):
        weights_in_format(load_gguf_weights(tiny_file[0])[1], "int8")


def test_held_out_text_is_a_notebooks_prose_or_a_files_code(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Title\nsome prose"),
                                         nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_markdown_cell("more")])
    nbformat.write(nb, tmp_path / "n.ipynb")
    assert held_out_text(tmp_path / "n.ipynb") == "# Title\nsome prose\n\nmore"
    (tmp_path / "m.py").write_text('"""A docstring\nof two lines."""\n\nimport os\nx = 1\n')
    assert held_out_text(tmp_path / "m.py") == "import os\nx = 1\n"
    with pytest.raises(ValueError, match="notebook or a .py file"):
        held_out_text(tmp_path / "m.txt")
