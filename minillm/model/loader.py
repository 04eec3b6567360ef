"""Load a model - a GGUF file or a Hugging Face directory - into a ready-to-run ``Model``.

    load_model()                       the default model (SmolLM2-135M-Instruct, Q4_1), fetched on first use
    load_model("model.gguf")           weights stay packed (Q8_0/Q4_0/Q4_1 as QMatrix; F16 -> fp32)
    load_model("Qwen3-0.6B/")          config.json + *.safetensors, weights as fp32
    load_model(activations="int8")     opt-in: linear inputs quantized to int8 blocks (numba backend)

On the numba backend the packed linear weights are repacked once, here, into the SIMD layout of
``quant_repack.RepackedMatrix`` (still a QMatrix: the file's bytes stay alongside). The embedding
table stays as the file has it: a lookup decodes a few rows, never a matvec.

Both paths produce the same ``ModelWeights`` and run the same forward. One difference is kept, not
undone: llama.cpp's converter stores the rows of attn_q and attn_k of ``llama`` files in an order
made for RoPE on adjacent pairs (REFERENCE.md). We keep the file's order and let
``ModelConfig.from_gguf`` choose ``rope_style = "pairs"``, which rotates exactly those
pairs - no weight is touched. ``unpermute_qk_rows`` below converts to the Hugging Face order instead
(chapter 05 uses it to compare GGUF weights with ``transformers`` row by row).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np

from minillm.kernels.quant_formats import QMatrix
from minillm.kernels.cpu.quant_repack import check_activations, repack
from minillm.kernels.registry import get_backend
from minillm.model.config import ModelConfig
from minillm.model.gguf import GGUFFile
from minillm.model.layers import LayerWeights, Weight
from minillm.model.safetensors import load_hf_directory
from minillm.model.transformer import Model, ModelWeights

# Where each weight lives in each format ({i} is the layer index).
GGUF_NAMES = {
    "embedding": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight",
    "layer": "blk.{i}.",
    "attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight",
    "wo": "attn_output.weight", "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "mlp_norm": "ffn_norm.weight", "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
}
HF_NAMES = {
    "embedding": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight",
    "layer": "model.layers.{i}.",
    "attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight", "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
}
LAYER_FIELDS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
LINEAR_FIELDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
QK_NORM_FIELDS = ("q_norm", "k_norm")

Keep = Callable[[ModelConfig], Callable[[str, Weight], Weight]]  # see read_weights


def load_model(path: str | Path | None = None, backend: str = "numba", activations: str = "fp32") -> Model:
    """A ``Model`` from a .gguf file or a Hugging Face directory; None -> the default model.

    ``activations``: "fp32" (exact: greedy tokens equal transformers') or "int8" (the inputs of the
    quantized linear layers' matvecs are quantized to int8 blocks, as llama.cpp does; numba only).
    """
    check_load_options(backend, activations)
    if path is None:
        from minillm.model.fetch import cached_model_path, fetch

        path = cached_model_path() or fetch()
    config, weights = read_weights(Path(path))
    if backend == "numba":
        weights = repack_linear_weights(weights, activations)
    return Model(config, weights, get_backend(backend))


def check_load_options(backend: str, activations: str) -> None:
    check_activations(activations)
    if activations == "int8" and backend != "numba":
        raise ValueError(f"activations='int8' runs on the numba backend only, not on {backend!r}")


def read_weights(path: Path, keep: Keep | None = None) -> tuple[ModelConfig, ModelWeights]:
    """Config and weights of a .gguf file or a Hugging Face directory, as the file stores them.

    ``keep(config)``, if given, returns a function (field, weight) -> the part of it to keep: a
    tensor-parallel rank keeps its shard (minillm/model/sharding.py). It runs on each tensor as
    read, before a layer's matrices are stacked, so a GGUF file's other parts are never copied.
    """
    if path.is_dir():
        return load_hf_weights(path, keep)
    if path.is_file():
        return load_gguf_weights(path, keep)
    raise FileNotFoundError(f"no model at {path}: expected a .gguf file or a Hugging Face model directory")


def repack_linear_weights(weights: ModelWeights, activations: str) -> ModelWeights:
    """Every packed weight a matvec reads in the SIMD layout: the stacked qkv and gate_up, the
    output projections, the LM head. Each is repacked once, after stacking (repacking wq, wk and
    wv first, then their stack again, did the work of the layer's projections twice at load)."""
    def simd(w: Weight) -> Weight:
        return repack(w, activations) if isinstance(w, QMatrix) else w

    layers = []
    for layer in weights.layers:
        layer = dataclasses.replace(layer, wo=simd(layer.wo), w_down=simd(layer.w_down))  # stacks qkv, gate_up anew
        layer.qkv, layer.gate_up = tuple(map(simd, layer.qkv)), tuple(map(simd, layer.gate_up))
        layers.append(layer)
    return dataclasses.replace(weights, layers=layers, lm_head=simd(weights.lm_head))


# -----------------------------------------------------------------------------
# the two formats

def load_gguf_weights(path: Path, keep: Keep | None = None) -> tuple[ModelConfig, ModelWeights]:
    """Config and weights of a GGUF file; quantized tensors stay packed (zero-copy views of the file)."""
    gguf = GGUFFile(path)
    config = ModelConfig.from_gguf(gguf)  # refuses architectures other than llama and qwen3
    return config, _assemble(config, GGUF_NAMES, gguf.tensors, gguf.tensor, path, keep)


def load_hf_weights(path: Path, keep: Keep | None = None) -> tuple[ModelConfig, ModelWeights]:
    """Config and fp32 weights of a Hugging Face directory (config.json + *.safetensors)."""
    config_dict, tensors = load_hf_directory(path)
    config = ModelConfig.from_hf_config(config_dict)  # refuses model types other than llama and qwen3
    return config, _assemble(config, HF_NAMES, tensors, tensors.__getitem__, path, keep)


def _assemble(config: ModelConfig, names: dict[str, str], available, read, path: Path,
              keep: Keep | None) -> ModelWeights:
    """ModelWeights from the tensors named by ``names``; ``read(name)`` returns one of ``available``."""
    part = keep(config) if keep is not None else None

    def tensor(field: str, name: str) -> Weight:
        if name not in available:
            raise ValueError(f"{path} has no tensor {name!r}, which a {config.architecture} model needs")
        weight = _as_weight(read(name), name)
        return weight if part is None else part(field, weight)

    fields = LAYER_FIELDS + (QK_NORM_FIELDS if config.qk_norm else ())
    layers = [LayerWeights(**{f: tensor(f, names["layer"].format(i=i) + names[f]) for f in fields})
              for i in range(config.n_layers)]
    embedding = tensor("embedding", names["embedding"])
    # A tied model uses the embedding as LM head (a checkpoint may still carry a copy of it).
    lm_head = embedding if config.tied_embeddings else tensor("lm_head", names["lm_head"])
    return ModelWeights(embedding=embedding, layers=layers, final_norm=tensor("final_norm", names["final_norm"]),
                        lm_head=lm_head)


def _as_weight(t: np.ndarray | QMatrix, name: str) -> Weight:
    """Packed blocks stay packed; F16/BF16/F32 arrays become float32 (our kernels are fp32)."""
    if isinstance(t, QMatrix):
        return t
    if not np.issubdtype(t.dtype, np.floating):
        raise TypeError(f"tensor {name!r} has dtype {t.dtype}, expected floating point weights")
    return np.ascontiguousarray(t, dtype=np.float32)


# -----------------------------------------------------------------------------
# the GGUF Q/K row order

def unpermute_qk_rows(w: np.ndarray | QMatrix, n_heads: int) -> np.ndarray | QMatrix:
    """Rows of a GGUF llama attn_q/attn_k weight (out, in) back in Hugging Face order.

    Within each head of dim d, the file's row 2i + t (t in {0, 1}) holds the original row
    i + t * d/2: the converter interleaved the two halves so RoPE can rotate adjacent pairs. Undoing
    it is a gather of whole rows, so a QMatrix is unpermuted by moving its packed rows - no
    dequantization. For K, pass the number of KV heads.
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of an even dimension")
    half = rows // n_heads // 2
    # HF row (h, t, i) is file row (h, i, t): read the file's rows in that order.
    order = np.arange(rows).reshape(n_heads, half, 2).transpose(0, 2, 1).reshape(rows)  # (rows,)
    if isinstance(w, QMatrix):
        return QMatrix(w.qtype, w.shape, np.ascontiguousarray(w.data[order]))  # (rows, packed bytes)
    return np.ascontiguousarray(np.asarray(w)[order])  # (rows, in)
