"""The transformer against Hugging Face transformers, the oracle.

Tiny random Llama and Qwen3 models (2 layers, hidden 64, 4 query / 2 KV heads) are built with
transformers, saved as safetensors (and, for Llama, written to GGUF with quantized weights, as
llama.cpp's converter would), loaded by minillm, and must produce transformers' logits: for a
flat batch of several prompts, through the KV cache one token at a time, and in prefill chunks.
The slow test does the same with the real SmolLM2-135M file.

Tolerance: both sides compute in float32 with different summation orders (BLAS vs our kernels,
softmax in another order); over 2 layers the logits agree to ~1e-6, we demand RTOL = ATOL = 1e-4.
On SmolLM2 (30 layers, logits of size ~20) they agree to ~1e-4; we demand 1e-3 and equal argmaxes.
"""
import dataclasses
from itertools import zip_longest

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

from minillm.kernels.cpu.quant import QMatrix, quantize
from minillm.kernels.registry import get_backend
from minillm.model.config import ModelConfig
from minillm.model.gguf import write_gguf
from minillm.model.kv_cache import AttentionMetadata, ContiguousKVCache
from minillm.model.layers import LayerContext, LayerWeights, decoder_layer
from minillm.model.loader import load_model

RTOL = ATOL = 1e-4
VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, CONTEXT = 256, 64, 128, 2, 4, 2, 16, 64
FAMILIES = {"llama": LlamaConfig, "qwen3": Qwen3Config}


def tiny_config(family: str, tied: bool):
    return FAMILIES[family](
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=CONTEXT, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        initializer_range=0.1,  # larger than the default 0.02, so the logits are far from flat
        attn_implementation="eager",
    )


def randomize_norms(module: torch.nn.Module) -> None:
    """Norm weights start at exactly 1; make them random so a forgotten scale would show."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))


def tiny_hf_model(family: str, tied: bool, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, tied)).eval()
    randomize_norms(model)
    return model


def hf_logits(model, token_ids) -> np.ndarray:
    """transformers' logits for one unpadded sequence -> (T, V)."""
    with torch.no_grad():
        return model(torch.tensor([list(token_ids)])).logits[0].float().numpy()


def prompts(lengths, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n) for n in lengths]


MODELS = [("llama", True), ("llama", False), ("qwen3", True), ("qwen3", False)]


@pytest.fixture(scope="module", params=MODELS, ids=[f"{f}-{'tied' if t else 'untied'}" for f, t in MODELS])
def tiny_pair(request, tmp_path_factory):
    """(transformers model, minillm model loaded from its safetensors directory)."""
    family, tied = request.param
    hf = tiny_hf_model(family, tied)
    path = tmp_path_factory.mktemp(f"{family}-{tied}")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, load_model(path)


# -----------------------------------------------------------------------------
# safetensors models: flat batches, decode, chunked prefill

def test_loaded_config_and_weights(tiny_pair):
    hf, model = tiny_pair
    assert model.config.architecture == hf.config.model_type
    assert model.config.rope_style == "half" and model.config.qk_norm == (hf.config.model_type == "qwen3")
    assert model.config.tied_embeddings == hf.config.tie_word_embeddings
    assert (model.weights.lm_head is model.weights.embedding) == hf.config.tie_word_embeddings
    hf_wk = hf.model.layers[1].self_attn.k_proj.weight.detach().numpy()  # (Hkv * Dh, D)
    np.testing.assert_array_equal(model.weights.layers[1].wk, hf_wk)


def test_flat_batch_of_prompts_matches_transformers(tiny_pair):
    """Four prompts of different lengths packed into ONE forward, logits at every row."""
    hf, model = tiny_pair
    seqs = prompts([5, 1, 9, 3])
    meta = AttentionMetadata(query_lens=[len(s) for s in seqs], context_lens=[0] * 4, seq_slots=[2, 0, 3, 1],
                             logits_indices=np.arange(18))
    logits = model.forward(np.concatenate(seqs), meta, model.new_cache(4, 16))  # (18, V)
    for b, seq in enumerate(seqs):
        rows = logits[meta.query_starts[b]:meta.query_starts[b + 1]]  # (T, V)
        np.testing.assert_allclose(rows, hf_logits(hf, seq), rtol=RTOL, atol=ATOL, err_msg=f"sequence {b}")


def test_reference_backend_runs_the_same_forward(tmp_path):
    """The NumPy reference kernels behind the same forward: the spec matches transformers too."""
    hf = tiny_hf_model("qwen3", tied=False)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(tmp_path, backend="reference")
    seqs = prompts([6, 3], seed=9)
    meta = AttentionMetadata(query_lens=[6, 3], context_lens=[0, 0], seq_slots=[0, 1], logits_indices=np.arange(9))
    logits = model.forward(np.concatenate(seqs), meta, model.new_cache(2, 8))  # (9, V)
    np.testing.assert_allclose(logits[:6], hf_logits(hf, seqs[0]), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(logits[6:], hf_logits(hf, seqs[1]), rtol=RTOL, atol=ATOL)


def test_default_logits_are_each_sequences_last_token(tiny_pair):
    hf, model = tiny_pair
    seqs = prompts([4, 7], seed=2)
    meta = AttentionMetadata(query_lens=[4, 7], context_lens=[0, 0], seq_slots=[0, 1])
    logits = model.forward(np.concatenate(seqs), meta, model.new_cache(2, 8))  # (2, V)
    expected = np.stack([hf_logits(hf, s)[-1] for s in seqs])  # (2, V)
    np.testing.assert_allclose(logits, expected, rtol=RTOL, atol=ATOL)


def run_schedule(model, seqs, chunks, slots, max_len) -> list[np.ndarray]:
    """Feed each sequence in the given chunks, all sequences together step by step, through one
    cache; return each sequence's logits at every position -> [(T_b, V)]."""
    cache = model.new_cache(max(slots) + 1, max_len)
    done = [0] * len(seqs)
    rows = [[] for _ in seqs]
    for step in zip_longest(*chunks):
        batch = [(b, n) for b, n in enumerate(step) if n is not None]
        meta = AttentionMetadata(query_lens=[n for _, n in batch], context_lens=[done[b] for b, _ in batch],
                                 seq_slots=[slots[b] for b, _ in batch],
                                 logits_indices=np.arange(sum(n for _, n in batch)))
        tokens = np.concatenate([seqs[b][done[b]:done[b] + n] for b, n in batch])  # (N,)
        logits = model.forward(tokens, meta, cache)                                # (N, V)
        for i, (b, n) in enumerate(batch):
            rows[b].append(logits[meta.query_starts[i]:meta.query_starts[i + 1]])
            done[b] += n
    return [np.concatenate(r) for r in rows]


def test_prefill_then_decode_matches_transformers(tiny_pair):
    """One prompt: prefill 6 tokens, then decode one token at a time through the cache."""
    hf, model = tiny_pair
    [seq] = prompts([14], seed=3)
    [ours] = run_schedule(model, [seq], [[6] + [1] * 8], slots=[0], max_len=14)
    np.testing.assert_allclose(ours, hf_logits(hf, seq), rtol=RTOL, atol=ATOL)


def test_chunked_prefill_mixed_with_decode_matches_transformers(tiny_pair):
    """Two sequences in one cache, in reversed slots: one decodes while the other is prefilled in
    chunks on top of its own cached context (the continuous-batching pattern)."""
    hf, model = tiny_pair
    seqs = prompts([10, 16], seed=4)
    chunks = [[4, 1, 1, 1, 1, 1, 1], [5, 3, 1, 6, 1]]
    ours = run_schedule(model, seqs, chunks, slots=[1, 0], max_len=20)
    for b, seq in enumerate(seqs):
        np.testing.assert_allclose(ours[b], hf_logits(hf, seq), rtol=RTOL, atol=ATOL, err_msg=f"sequence {b}")


def test_cache_refuses_a_sequence_past_max_len(tiny_pair):
    _, model = tiny_pair
    meta = AttentionMetadata(query_lens=[3], context_lens=[6], seq_slots=[0])
    with pytest.raises(ValueError, match="max_len 8"):
        model.forward(np.zeros(3, dtype=np.int64), meta, model.new_cache(1, 8))


def test_forward_refuses_bad_batches(tiny_pair):
    _, model = tiny_pair
    meta = AttentionMetadata(query_lens=[2], context_lens=[0], seq_slots=[0])
    cache = model.new_cache(1, 8)
    with pytest.raises(ValueError, match="token ids"):
        model.forward(np.array([1, VOCAB]), meta, cache)
    with pytest.raises(ValueError, match="describes 2"):
        model.forward(np.array([1, 2, 3]), meta, cache)
    past_context = AttentionMetadata(query_lens=[2], context_lens=[CONTEXT - 1], seq_slots=[0])  # positions C-1, C
    with pytest.raises(ValueError, match="context length"):
        model.forward(np.array([1, 2]), past_context, model.new_cache(1, CONTEXT + 1))


def test_attention_metadata_derives_starts_positions_and_logit_rows():
    meta = AttentionMetadata(query_lens=[3, 1, 2], context_lens=[0, 7, 4], seq_slots=[0, 1, 2])
    np.testing.assert_array_equal(meta.query_starts, [0, 3, 4, 6])
    np.testing.assert_array_equal(meta.positions, [0, 1, 2, 7, 4, 5])
    np.testing.assert_array_equal(meta.logits_indices, [2, 3, 5])
    assert meta.max_position == 7
    np.testing.assert_array_equal(AttentionMetadata([1], [20], [0]).positions, [20])  # a decode step
    with pytest.raises(ValueError, match="share a cache slot"):
        AttentionMetadata(query_lens=[1, 1], context_lens=[0, 0], seq_slots=[0, 0])
    with pytest.raises(ValueError, match="seq_slots must be >= 0"):
        AttentionMetadata(query_lens=[1], context_lens=[0], seq_slots=[-1])


def test_load_model_names_a_missing_tensor(tmp_path):
    hf = tiny_hf_model("llama", tied=True)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(tmp_path)


# -----------------------------------------------------------------------------
# GGUF: packed weights, Q/K rows in llama.cpp's order, against transformers reading the same file

def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF -> GGUF row order, as llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute) writes it."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_llama_gguf(hf, path, linear_qtype: str, embedding_type: str):
    """The tiny HF Llama as llama.cpp's converter would write it: Q/K rows reordered, linear weights
    in ``linear_qtype``, norms F32, the embedding in ``embedding_type`` (a block format or "F16").
    transformers needs no tokenizer.* keys to build the model (the vocabulary size is llama.vocab_size)."""
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}

    def linear(w):
        return quantize(w, linear_qtype)

    embedding = state["model.embed_tokens.weight"]  # (V, D)
    tensors = {"token_embd.weight": embedding.astype(np.float16) if embedding_type == "F16"
               else quantize(embedding, embedding_type),
               "output_norm.weight": state["model.norm.weight"]}
    if not hf.config.tie_word_embeddings:
        tensors["output.weight"] = linear(state["lm_head.weight"])
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {
            f"blk.{i}.attn_norm.weight": state[p + "input_layernorm.weight"],
            f"blk.{i}.attn_q.weight": linear(llama_cpp_permute(state[p + "self_attn.q_proj.weight"], HEADS)),
            f"blk.{i}.attn_k.weight": linear(llama_cpp_permute(state[p + "self_attn.k_proj.weight"], KV_HEADS)),
            f"blk.{i}.attn_v.weight": linear(state[p + "self_attn.v_proj.weight"]),
            f"blk.{i}.attn_output.weight": linear(state[p + "self_attn.o_proj.weight"]),
            f"blk.{i}.ffn_norm.weight": state[p + "post_attention_layernorm.weight"],
            f"blk.{i}.ffn_gate.weight": linear(state[p + "mlp.gate_proj.weight"]),
            f"blk.{i}.ffn_up.weight": linear(state[p + "mlp.up_proj.weight"]),
            f"blk.{i}.ffn_down.weight": linear(state[p + "mlp.down_proj.weight"]),
        }
    metadata = {
        "general.architecture": "llama", "general.name": "tiny-llama",
        "llama.block_count": LAYERS, "llama.context_length": CONTEXT, "llama.embedding_length": HIDDEN,
        "llama.feed_forward_length": FFN, "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": KV_HEADS, "llama.rope.dimension_count": HEAD_DIM,
        "llama.rope.freq_base": 10000.0, "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.vocab_size": VOCAB,
    }
    write_gguf(path, metadata, tensors)


GGUF_CASES = [("Q8_0", "Q8_0", False), ("Q4_1", "F16", True)]  # (linear weights, embedding, tied)


@pytest.mark.parametrize("linear_qtype, embedding_type, tied", GGUF_CASES,
                         ids=["Q8_0-untied", "Q4_1-F16-embedding-tied"])
def test_gguf_model_matches_transformers_reading_the_same_file(tmp_path, linear_qtype, embedding_type, tied):
    """Packed weights in llama.cpp's Q/K order (rope_style "pairs") vs transformers, which reads
    the same file, dequantizes it with the gguf package and undoes the row order itself."""
    hf = tiny_hf_model("llama", tied, seed=5)
    write_tiny_llama_gguf(hf, tmp_path / "tiny.gguf", linear_qtype, embedding_type)
    model = load_model(tmp_path / "tiny.gguf")
    assert model.config.rope_style == "pairs" and model.config.tied_embeddings == tied
    assert isinstance(model.weights.layers[0].wq, QMatrix) and model.weights.layers[0].wq.qtype == linear_qtype
    oracle = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32).eval()

    seqs = prompts([7, 12], seed=6)
    meta = AttentionMetadata(query_lens=[7, 12], context_lens=[0, 0], seq_slots=[0, 1], logits_indices=np.arange(19))
    logits = model.forward(np.concatenate(seqs), meta, model.new_cache(2, 16))  # (19, V)
    np.testing.assert_allclose(logits[:7], hf_logits(oracle, seqs[0]), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(logits[7:], hf_logits(oracle, seqs[1]), rtol=RTOL, atol=ATOL)
    [decoded] = run_schedule(model, seqs[1:], [[5] + [1] * 7], slots=[0], max_len=12)  # the packed matvec path
    np.testing.assert_allclose(decoded, hf_logits(oracle, seqs[1]), rtol=RTOL, atol=ATOL)


# -----------------------------------------------------------------------------
# the real model

SMOLLM2_PROMPT = ("The quick brown fox jumps over the lazy dog. Rotary position embeddings rotate "
                  "pairs of coordinates by angles that grow with the position of each token in the sequence, "
                  "so attention sees relative distances.")
SMOLLM2_ATOL = 1e-3  # 30 layers of fp32 in another order, logits of size ~20: measured ~1e-4


@pytest.fixture(scope="module")
def smollm2(smollm2_path, hf_smollm2):
    """(our model, 32 prompt token ids, transformers' fp32 logits for them (32, V)) - computed once."""
    oracle, tokenizer = hf_smollm2  # conftest.py: transformers reading the same GGUF file
    ids = tokenizer(SMOLLM2_PROMPT)["input_ids"][:32]
    assert len(ids) == 32
    return load_model(smollm2_path), np.array(ids), hf_logits(oracle, ids)


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2):
    model, ids, expected = smollm2
    meta = AttentionMetadata(query_lens=[32], context_lens=[0], seq_slots=[0], logits_indices=np.arange(32))
    logits = model.forward(ids, meta, model.new_cache(1, 32))  # (32, V)
    max_diff = np.abs(logits - expected).max()
    print(f"SmolLM2-135M Q4_1, 32 tokens: max |logit difference| vs transformers = {max_diff:.2e}")
    assert max_diff < SMOLLM2_ATOL
    np.testing.assert_array_equal(logits.argmax(-1), expected.argmax(-1))


@pytest.mark.slow
def test_smollm2_decode_through_the_cache_matches_transformers(smollm2):
    """Prefill 24 tokens, then 8 decode steps: the packed-matvec path on the real model."""
    model, ids, expected = smollm2
    [logits] = run_schedule(model, [ids], [[24] + [1] * 8], slots=[0], max_len=32)  # (32, V)
    assert np.abs(logits - expected).max() < SMOLLM2_ATOL
    np.testing.assert_array_equal(logits.argmax(-1), expected.argmax(-1))


# -----------------------------------------------------------------------------
# chapter 05 exercises

@pytest.mark.ch05_rope_convention
@pytest.mark.parametrize("n_heads", [HEADS, KV_HEADS])
def test_unpermute_qk_rows_restores_the_hf_order(impl, n_heads):
    m = impl("ch05_transformer")
    rng = np.random.default_rng(7)
    w_hf = rng.standard_normal((n_heads * HEAD_DIM, HIDDEN)).astype(np.float32)  # (rows, in)
    np.testing.assert_array_equal(m.unpermute_qk_rows(llama_cpp_permute(w_hf, n_heads), n_heads), w_hf)
    # packed rows move whole: quantizing then permuting rows equals permuting then quantizing
    packed_hf = quantize(w_hf, "Q4_1")
    packed_gguf = QMatrix("Q4_1", packed_hf.shape, llama_cpp_permute(packed_hf.data, n_heads))
    restored = m.unpermute_qk_rows(packed_gguf, n_heads)
    assert isinstance(restored, QMatrix) and restored.qtype == "Q4_1" and restored.shape == packed_hf.shape
    np.testing.assert_array_equal(restored.data, packed_hf.data)


def layer_weights_of(layer) -> LayerWeights:
    """A transformers decoder layer's weights as minillm's LayerWeights (fp32, HF row order)."""
    def w(module):
        return module.weight.detach().numpy()

    attn, mlp = layer.self_attn, layer.mlp
    qk_norm = getattr(attn, "q_norm", None) is not None
    return LayerWeights(attn_norm=w(layer.input_layernorm), wq=w(attn.q_proj), wk=w(attn.k_proj),
                        wv=w(attn.v_proj), wo=w(attn.o_proj), mlp_norm=w(layer.post_attention_layernorm),
                        w_gate=w(mlp.gate_proj), w_up=w(mlp.up_proj), w_down=w(mlp.down_proj),
                        q_norm=w(attn.q_norm) if qk_norm else None, k_norm=w(attn.k_norm) if qk_norm else None)


DECODER_LAYERS = {"llama": (LlamaDecoderLayer, LlamaRotaryEmbedding),
                  "qwen3": (Qwen3DecoderLayer, Qwen3RotaryEmbedding)}


@pytest.mark.ch05_decoder_layer
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_decoder_layer_matches_transformers(impl, family):
    """One layer on 11 tokens, given as a 7-token prefill and a 4-token chunk on top of it."""
    m = impl("ch05_transformer")
    torch.manual_seed(8)
    hf_config = tiny_config(family, tied=True)
    layer_cls, rotary_cls = DECODER_LAYERS[family]
    hf_layer = layer_cls(hf_config, layer_idx=0).eval()
    randomize_norms(hf_layer)
    x = torch.randn(1, 11, HIDDEN)  # (1, T, D)
    positions = torch.arange(11)[None]  # (1, T)
    causal = torch.full((11, 11), float("-inf")).triu(1)[None, None]  # (1, 1, T, T)
    with torch.no_grad():
        expected = hf_layer(x, attention_mask=causal, position_ids=positions,
                            position_embeddings=rotary_cls(hf_config)(x, positions))[0].numpy()  # (T, D)

    config = ModelConfig.from_hf_config(hf_config.to_dict())
    ctx = LayerContext.build(config, get_backend("numba"))  # config, kernel ops, RoPE tables
    weights = layer_weights_of(hf_layer)
    cache = ContiguousKVCache(config, n_slots=1, max_len=16)
    outputs = []
    for first, last in [(0, 7), (7, 11)]:
        meta = AttentionMetadata(query_lens=[last - first], context_lens=[first], seq_slots=[0])
        out = m.decoder_layer(x[0, first:last].numpy(), weights, 0, cache, meta, ctx)
        outputs.append(out)  # (T_chunk, D)
    np.testing.assert_allclose(np.concatenate(outputs), expected, rtol=RTOL, atol=ATOL)


def test_layer_weights_stack_qkv_and_gate_up_as_views_of_one_copy():
    rng = np.random.default_rng(3)
    w = {name: quantize(rng.standard_normal((rows, HIDDEN)).astype(np.float32), "Q4_1")
         for name, rows in [("wq", 64), ("wk", 32), ("wv", 32), ("w_gate", FFN), ("w_up", FFN)]}
    fp32 = rng.standard_normal((HIDDEN, 64)).astype(np.float32)
    norm = np.ones(HIDDEN, np.float32)
    lw = LayerWeights(attn_norm=norm, wo=fp32, mlp_norm=norm, w_down=fp32.T.copy(), **w)
    [qkv] = lw.qkv
    assert qkv.shape == (128, HIDDEN) and lw.gate_up[0].shape == (2 * FFN, HIDDEN)
    for name, original in w.items():
        stacked = getattr(lw, name)
        assert stacked.shape == original.shape
        np.testing.assert_array_equal(stacked.data, original.data)
    assert np.shares_memory(lw.wk.data, qkv.data) and np.shares_memory(lw.w_up.data, lw.gate_up[0].data)
    mixed = LayerWeights(attn_norm=norm, wo=fp32, mlp_norm=norm, w_down=fp32.T.copy(),
                         **(w | {"wv": quantize(rng.standard_normal((32, HIDDEN)).astype(np.float32), "Q8_0")}))
    assert len(mixed.qkv) == 3 and len(mixed.gate_up) == 1  # formats differ: three matvecs, outputs joined


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_decoder_layer_with_unstackable_weights_matches_the_stacked_one(family):
    """wv in another block format than wq/wk (as some GGUF files mix them): the q, k, v matvecs
    run apart and their outputs are joined - the same layer output as stacked weights holding
    the same (dequantized) values."""
    torch.manual_seed(9)
    hf_config = tiny_config(family, tied=True)
    hf_layer = DECODER_LAYERS[family][0](hf_config, layer_idx=0).eval()
    randomize_norms(hf_layer)
    config = ModelConfig.from_hf_config(hf_config.to_dict())
    ctx = LayerContext.build(config, get_backend("numba"))
    fp32 = layer_weights_of(hf_layer)
    wv = quantize(fp32.wv, "Q8_0")
    mixed = dataclasses.replace(fp32, wv=wv)                  # fp32 wq, wk next to a Q8_0 wv: not stackable
    same_values = dataclasses.replace(fp32, wv=wv.dequantize())  # the same numbers, all fp32: stacked
    assert len(mixed.qkv) == 3 and len(same_values.qkv) == 1
    x = np.random.default_rng(2).standard_normal((5, HIDDEN)).astype(np.float32)  # (T, D)
    meta = AttentionMetadata(query_lens=[5], context_lens=[0], seq_slots=[0])
    outs = [decoder_layer(x, w, 0, ContiguousKVCache(config, 1, 8), meta, ctx) for w in (mixed, same_values)]
    np.testing.assert_allclose(outs[0], outs[1], rtol=RTOL, atol=ATOL)
