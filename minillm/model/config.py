"""The numbers that define a decoder-only transformer, read from GGUF metadata or a Hugging Face config.

Two families are supported, and they differ in only three ways:

    family   checkpoint          RoPE pairs                      QK-norm   GGUF keys
    llama    GGUF (llama.cpp)    adjacent (2i, 2i+1): "pairs"    no        llama.*
    llama    Hugging Face        halves (i, i + d/2): "half"     no
    qwen3    GGUF or HF          halves: "half"                  yes       qwen3.*

llama.cpp's converter reorders the rows of attn_q/attn_k in llama files so that RoPE rotates
adjacent pairs; Qwen files are not reordered, so they keep Hugging Face's rotate-half convention.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from minillm.model.gguf import GGUFFile

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen3")
SUPPORTED_HF_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "qwen3"
    n_layers: int
    hidden_size: int  # D
    intermediate_size: int  # F, the SwiGLU width
    n_heads: int  # H, query heads
    n_kv_heads: int  # Hkv, key/value heads (GQA: H % Hkv == 0)
    head_dim: int  # Dh (not always D / H: Qwen3-0.6B has D 1024, H 16, Dh 128)
    rope_theta: float
    rope_style: str  # "half" (HF) | "pairs" (GGUF llama)
    rms_eps: float
    vocab_size: int
    tied_embeddings: bool  # the LM head is the token embedding matrix
    qk_norm: bool  # RMSNorm on each head of q and k before RoPE (Qwen3)
    context_length: int

    def __post_init__(self):
        for name in ("n_layers", "hidden_size", "intermediate_size", "n_heads", "n_kv_heads", "head_dim",
                     "vocab_size", "context_length"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.rope_style not in ("half", "pairs"):
            raise ValueError(f"rope_style must be 'half' or 'pairs', got {self.rope_style!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.n_heads} query heads cannot be shared evenly by {self.n_kv_heads} KV heads")
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")

    # -------------------------------------------------------------------------------------------
    # From a GGUF file

    @classmethod
    def from_gguf(cls, gguf: GGUFFile | str | os.PathLike) -> ModelConfig:
        """From a GGUFFile (or a path to one): its metadata plus its tensor names."""
        gguf = gguf if isinstance(gguf, GGUFFile) else GGUFFile(gguf)
        return cls.from_gguf_metadata(gguf.metadata, gguf.tensors)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], tensor_names: Iterable[str]) -> ModelConfig:
        """GGUF metadata (llama.* or qwen3.* keys) and the file's tensor names. The names matter
        because GGUF has no key for tied embeddings: a file without output.weight ties them."""
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {arch!r}: minillm runs "
                             f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
        tensor_names = set(tensor_names)

        def key(name: str, default: Any = None):
            full = f"{arch}.{name}"
            if full not in meta and default is None:
                raise ValueError(f"GGUF metadata lacks {full!r}, which a {arch} model needs")
            return meta.get(full, default)

        scaling = meta.get(f"{arch}.rope.scaling.type", "none")
        if scaling != "none" or "rope_freqs.weight" in tensor_names:
            raise ValueError(f"RoPE scaling ({scaling if scaling != 'none' else 'rope_freqs.weight'}) "
                             f"is not supported")
        hidden, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
        vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
        if not vocab:
            raise ValueError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
        return cls(
            architecture=arch,
            n_layers=int(key("block_count")),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=int(key("attention.head_count_kv", n_heads)),
            head_dim=int(key("attention.key_length", hidden // n_heads)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_style="pairs" if arch == "llama" else "half",
            rms_eps=float(key("attention.layer_norm_rms_epsilon")),
            vocab_size=int(vocab),
            tied_embeddings="output.weight" not in tensor_names,
            qk_norm=arch == "qwen3",
            context_length=int(key("context_length")),
        )

    # -------------------------------------------------------------------------------------------
    # From a Hugging Face config.json

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelConfig:
        """A config.json dict of LlamaForCausalLM or Qwen3ForCausalLM."""
        model_type = config.get("model_type")
        architectures = config.get("architectures") or []
        if model_type not in SUPPORTED_HF_MODEL_TYPES:
            raise ValueError(f"unsupported Hugging Face model_type {model_type!r} "
                             f"(architectures {architectures}): minillm runs "
                             f"{', '.join(SUPPORTED_HF_MODEL_TYPES.values())}")
        for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
            if config.get(flag):
                raise ValueError(f"{model_type} with {flag} = true is not supported")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (SwiGLU needs silu)")
        # transformers >= 5 nests RoPE settings in rope_parameters; older configs keep them at the top.
        rope = config.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default" or config.get("rope_scaling"):
            raise ValueError(f"RoPE scaling ({rope_type if rope_type != 'default' else config['rope_scaling']}) "
                             f"is not supported")
        hidden, n_heads = config["hidden_size"], config["num_attention_heads"]
        return cls(
            architecture=model_type,
            n_layers=config["num_hidden_layers"],
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            head_dim=config.get("head_dim") or hidden // n_heads,
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            rope_style="half",
            rms_eps=float(config["rms_norm_eps"]),
            vocab_size=config["vocab_size"],
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            qk_norm=model_type == "qwen3",
            context_length=config.get("max_position_embeddings", 2048),
        )

    # -------------------------------------------------------------------------------------------
    # Where the parameters are

    def layer_parameters(self) -> dict[str, int]:
        """Parameters of one decoder layer, by weight."""
        D, F, Dh = self.hidden_size, self.intermediate_size, self.head_dim
        table = {
            "attn_norm": D,
            "attn_q": D * self.n_heads * Dh,
            "attn_k": D * self.n_kv_heads * Dh,
            "attn_v": D * self.n_kv_heads * Dh,
            "attn_output": self.n_heads * Dh * D,
            "ffn_norm": D,
            "ffn_gate": D * F,
            "ffn_up": D * F,
            "ffn_down": F * D,
        }
        if self.qk_norm:
            table |= {"attn_q_norm": Dh, "attn_k_norm": Dh}
        return table

    def parameter_count(self) -> dict[str, int]:
        """Parameters of the whole model: embedding, all layers, final norm, LM head, total."""
        embedding = self.vocab_size * self.hidden_size
        counts = {
            "embedding": embedding,
            "per_layer": sum(self.layer_parameters().values()),
            "layers": self.n_layers * sum(self.layer_parameters().values()),
            "final_norm": self.hidden_size,
            "lm_head": 0 if self.tied_embeddings else embedding,  # tied: shares the embedding
        }
        counts["total"] = counts["embedding"] + counts["layers"] + counts["final_norm"] + counts["lm_head"]
        return counts
