"""Chapter 03's kernels where a forward runs them: a tiny random Llama (1 layer, D 32) on the
learner's CUDA kernels, beside the same model on the package's CPU kernels.

    matmul_tiled   every linear layer: x @ W.T
    rms_norm       every RMSNorm
    vector_add     the decoder layer's two residual adds
    reduce_sum     attention's softmax denominators (one sum per query row and head)

It runs in a process of its own (``main`` below): without a GPU, Numba's
CUDA simulator must be switched on before numba is first imported, and the parent has imported
it. The simulator runs one Python thread per GPU thread, so the model is tiny and runs one
4-token forward. The child prints JSON: calls per task, both runs' argmax tokens, the largest
logit difference, and the device.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

TASKS = ("ch03_vector_add", "ch03_block_reduce", "ch03_tiled_matmul", "ch03_rmsnorm")
TOKENS = np.array([3, 14, 15, 9])  # the prompt of the tiny model (vocabulary 64)


def whose(marker: str) -> str:
    from minillm.course.seats import written
    return "yours" if written(marker) else "package (not written yet)"


def run(chapter: str, reach) -> tuple[tuple, tuple]:
    """Run the child; add its calls to ``reach``; ((package tokens, device), (your tokens, device))."""
    from minillm.hardware.gpu import gpu_available
    env = dict(os.environ)
    if not gpu_available():
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    child = subprocess.run([sys.executable, "-c", "from minillm.course.cuda_seat import main; main()"],
                           capture_output=True, text=True, env=env, timeout=600)
    if child.returncode != 0:
        raise RuntimeError(f"chapter 03's forward failed:\n{child.stderr[-2000:]}")
    out = json.loads(child.stdout.strip().splitlines()[-1])
    reach.update(out["calls"])
    device = f"{out['device']}, largest logit difference {out['max_abs_diff']:.1e}"
    return ([out["package"]], device), ([out["yours"]], device)


def _tiny_model(ops):
    from minillm.model.config import ModelConfig
    from minillm.model.layers import LayerWeights
    from minillm.model.transformer import Model, ModelWeights

    config = ModelConfig("llama", n_layers=1, hidden_size=32, intermediate_size=64, n_heads=2, n_kv_heads=1,
                         head_dim=16, rope_theta=10000.0, rope_style="half", rms_eps=1e-5, vocab_size=64,
                         tied_embeddings=True, qk_norm=False, context_length=16)
    rng = np.random.default_rng(0)
    f32 = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float32)  # noqa: E731
    layer = LayerWeights(attn_norm=1 + f32(32), wq=f32(32, 32), wk=f32(16, 32), wv=f32(16, 32), wo=f32(32, 32),
                         mlp_norm=1 + f32(32), w_gate=f32(64, 32), w_up=f32(64, 32), w_down=f32(32, 64))
    embedding = f32(64, 32)
    return Model(config, ModelWeights(embedding=embedding, layers=[layer], final_norm=1 + f32(32), lm_head=embedding), ops)


def _forward(model) -> np.ndarray:
    from minillm.model.kv_cache import AttentionMetadata
    meta = AttentionMetadata(query_lens=[len(TOKENS)], context_lens=[0], seq_slots=[0],
                             logits_indices=np.arange(len(TOKENS)))
    return model.forward(TOKENS, meta, model.new_cache(n_slots=1, max_len=16))  # (4, 64)


def _learner_ops(reach):
    """The numba backend with the learner's CUDA kernels where chapter 03's tasks sit."""
    from minillm.course.learner_ops import with_softmax
    from minillm.course.seats import learner_pieces, written
    from minillm.kernels import reference
    from minillm.kernels.registry import Backend, OPS, get_backend

    numba_ops = get_backend("numba")
    ops = {op: getattr(numba_ops, op) for op in OPS}
    mine = {name: reach.counted(marker, fn) for marker in TASKS if written(marker)
            for name, fn in learner_pieces(marker).items()}
    if "matmul_tiled" in mine:
        ops["linear"] = lambda x, w: mine["matmul_tiled"](np.ascontiguousarray(x), np.ascontiguousarray(w.T))
    if "rms_norm" in mine:
        ops["rms_norm"] = mine["rms_norm"]
    if "reduce_sum" in mine:
        def softmax(x):  # (..., N) -> (..., N); each row's denominator summed by the learner's reduction
            e = np.exp(x - x.max(axis=-1, keepdims=True)).astype(np.float32)
            sums = np.array([mine["reduce_sum"](row) for row in e.reshape(-1, e.shape[-1])], np.float32)
            return e / sums.reshape(*e.shape[:-1], 1)
        ops["attention"] = with_softmax(reference.attention, softmax)
    return Backend("exercises (chapter 03)", ops), mine.get("vector_add")


def _with_residual_add(vector_add):
    """transformer.decoder_layer with its two residual adds through ``vector_add`` (the rest is
    layers.decoder_layer's, step for step)."""
    from minillm.model.layers import self_attention, swiglu_mlp

    def add(a, b):
        return vector_add(np.ascontiguousarray(a).ravel(), np.ascontiguousarray(b).ravel()).reshape(a.shape)

    def decoder_layer(x, weights, layer, cache, meta, ctx):
        eps, ops = ctx.config.rms_eps, ctx.ops
        h = add(x, self_attention(ops.rms_norm(x, weights.attn_norm, eps), weights, layer, cache, meta, ctx))
        return add(h, swiglu_mlp(ops.rms_norm(h, weights.mlp_norm, eps), weights, ops))
    return decoder_layer


def main() -> None:
    from minillm.course.learner_ops import Reach
    from minillm.hardware.gpu import gpu_status
    from minillm.kernels.registry import get_backend
    from minillm.model import transformer

    package = _forward(_tiny_model(get_backend("numba")))  # (4, 64)
    reach = Reach()
    ops, vector_add = _learner_ops(reach)
    original = transformer.decoder_layer
    if vector_add is not None:
        transformer.decoder_layer = _with_residual_add(vector_add)
    try:
        yours = _forward(_tiny_model(ops))  # (4, 64)
    finally:
        transformer.decoder_layer = original
    status = gpu_status()
    print(json.dumps({"calls": dict(reach), "package": package.argmax(-1).tolist(), "yours": yours.argmax(-1).tolist(),
                      "max_abs_diff": float(np.abs(package - yours).max()),
                      "device": "a GPU" if status == "available" else "the CUDA simulator"}))
