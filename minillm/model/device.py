"""The model resident on the GPU: weights uploaded once, the same forward on the device.

    model = to_device(load_model(path, backend="reference"))   # what LLM(device="cuda") does

Every weight crosses the bus once, here: packed GGUF blocks (Q8_0, Q4_0, Q4_1) as they are
(`GPUQMatrix`: the kernels decode them), fp32 weights, norms and the RoPE tables as fp32
`DeviceTensor`s. The stacked qkv and gate_up matrices are uploaded once and the separate wq, wk,
wv, w_gate, w_up become row views of them, as on the host (one copy of the data).

`DeviceModel` is a `Model` with the resident backend (kernels/cuda/resident.py): its forward is
`Model.forward`, unchanged, and only the logits of the rows asked for come back to the host.
Each forward's bus traffic and kernel launches (kernels/cuda/setup.py counts them) are kept in
`last_forward`: what one engine step cost, for the profiler and chapter 03.
"""
from __future__ import annotations

import copy

import numpy as np

from minillm.kernels.cuda.quant import GPUQMatrix
from minillm.kernels.cuda.resident import ResidentBackend
from minillm.kernels.cuda.setup import TRAFFIC, BusTraffic, cuda_available
from minillm.kernels.cuda.tensor import DeviceTensor
from minillm.kernels.quant_formats import QMatrix
from minillm.model.kv_cache import AttentionMetadata, KVCache
from minillm.model.layers import LayerWeights, Weight
from minillm.model.transformer import Model, ModelWeights

DEVICES = ("cpu", "cuda")


def check_device(device: str) -> None:
    """Refuse a device this machine cannot run, before anything is loaded, saying what to do."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda":
        available, reason = cuda_available()
        if not available:
            raise RuntimeError(f"device='cuda' needs an NVIDIA GPU or Numba's CUDA simulator. {reason}. "
                               "To run on the simulator: NUMBA_ENABLE_CUDASIM=1 python your_script.py "
                               "(tiny models only: it runs each GPU thread as a Python thread)")


def upload_weight(w: Weight):
    if isinstance(w, QMatrix):
        return GPUQMatrix.upload(w)
    return DeviceTensor.upload(np.asarray(w))


def device_row_views(stacked, *ws: Weight) -> list:
    """ws as consecutive row ranges of the device matrix ``stacked`` (views, no copy)."""
    views, first = [], 0
    for w in ws:
        last = first + w.shape[0]
        views.append(stacked.rows(first, last) if isinstance(stacked, GPUQMatrix) else stacked[first:last])
        first = last
    return views


def upload_layer(layer: LayerWeights) -> LayerWeights:
    on_device = copy.copy(layer)  # not dataclasses.replace: __post_init__ would stack the rows again
    on_device.qkv = tuple(map(upload_weight, layer.qkv))
    on_device.gate_up = tuple(map(upload_weight, layer.gate_up))
    if len(layer.qkv) == 1:
        on_device.wq, on_device.wk, on_device.wv = device_row_views(on_device.qkv[0], layer.wq, layer.wk, layer.wv)
    else:
        on_device.wq, on_device.wk, on_device.wv = on_device.qkv
    if len(layer.gate_up) == 1:
        on_device.w_gate, on_device.w_up = device_row_views(on_device.gate_up[0], layer.w_gate, layer.w_up)
    else:
        on_device.w_gate, on_device.w_up = on_device.gate_up
    on_device.wo, on_device.w_down = upload_weight(layer.wo), upload_weight(layer.w_down)
    for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm"):
        if getattr(layer, name) is not None:
            setattr(on_device, name, upload_weight(getattr(layer, name)))
    return on_device


class DeviceModel(Model):
    """A Model whose weights, activations and (paged) KV cache live on the GPU."""

    device = "cuda"
    last_forward: BusTraffic | None = None  # copies, bytes and launches of the latest forward

    def forward(self, token_ids: np.ndarray, meta: AttentionMetadata, cache: KVCache,
                num_layers: int | None = None) -> np.ndarray:
        """Model.forward on the device; the logits of the rows asked for come back -> (L, V) host array."""
        before = TRAFFIC.snapshot()
        logits = super().forward(token_ids, meta, cache, num_layers).to_host()  # (L, V)
        self.last_forward = TRAFFIC.since(before)
        return logits

    def new_cache(self, n_slots: int, max_len: int):
        raise RuntimeError("the contiguous KV cache lives in host memory; a model on the GPU runs in the "
                           "engine (LLM(device='cuda')), whose paged KV cache is in device memory")


def to_device(model: Model) -> DeviceModel:
    """The model with every weight uploaded once (the embedding doubles as the LM head when tied)."""
    check_device("cuda")
    w = model.weights
    embedding = upload_weight(w.embedding)
    lm_head = embedding if w.lm_head is w.embedding else upload_weight(w.lm_head)
    weights = ModelWeights(embedding=embedding, layers=[upload_layer(layer) for layer in w.layers],
                           final_norm=upload_weight(w.final_norm), lm_head=lm_head)
    return DeviceModel(model.config, weights, ResidentBackend())
