"""Where a forward's time goes: a timer around every kernel op, grouped into operator families.

No kernel is edited. ``OpTimer.backend(ops)`` is a backend whose every op is the original one
between two clock readings, and ``OpTimer.model(model)`` is the same model (the same weights, not a
copy) running on it. A linear op is counted in the family of the weight it multiplies - the QKV
projection, the FFN's down projection, the LM head... - found by the weight's identity, so a
profile says *which* matrices take the time, not only that matvecs do. The other ops are grouped
by what they compute (every attention kernel is "attention", silu and swiglu are "swiglu").

The bound to hold a profile against is ``weight_bytes_by_family``: a decode step reads each of
those matrices once, so no family can take less than its bytes over the memory bandwidth.
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

from minillm.kernels.registry import OPS, Backend
from minillm.model.transformer import Model

# op name -> family, for the ops that do not multiply a weight matrix
OP_FAMILIES = {"rms_norm": "rms_norm", "rope": "rope", "rope_table": "rope", "swiglu": "swiglu", "silu": "swiglu",
               "attention": "attention", "attention_decode": "attention", "softmax": "attention",
               "paged_attention_decode": "attention", "paged_attention_prefill": "attention",
               "embedding": "embedding", "qembedding": "embedding", "matmul": "matmul"}
# the families of the weight matrices: each linear op is counted in one of these
WEIGHT_FAMILIES = ("qkv proj", "attn output proj", "ffn gate/up", "ffn down", "LM head")
_LAYER_FIELDS = {"wq": "qkv proj", "wk": "qkv proj", "wv": "qkv proj", "wo": "attn output proj",
                 "w_gate": "ffn gate/up", "w_up": "ffn gate/up", "w_down": "ffn down"}


def weight_families(model: Model) -> dict[int, str]:
    """id(weight) -> its family, for every matrix a linear op may be handed (stacked ones included)."""
    families = {id(model.weights.lm_head): "LM head"}
    for layer in model.weights.layers:
        families.update({id(getattr(layer, name)): family for name, family in _LAYER_FIELDS.items()})
        families.update({id(w): "qkv proj" for w in layer.qkv})         # stacked Q, K, V: one matrix
        families.update({id(w): "ffn gate/up" for w in layer.gate_up})  # stacked gate and up
    return families


def weight_bytes_by_family(model: Model) -> dict[str, int]:
    """Bytes of the matrices one forward multiplies, per family: what a decode step must read.

    Counted as the forward reads them - the stacked QKV and gate/up matrices once each, not their
    row views again - and the LM head once, even when it is the embedding table (tied).
    """
    total = dict.fromkeys(WEIGHT_FAMILIES, 0)
    for layer in model.weights.layers:
        total["qkv proj"] += sum(w.nbytes for w in layer.qkv)
        total["attn output proj"] += layer.wo.nbytes
        total["ffn gate/up"] += sum(w.nbytes for w in layer.gate_up)
        total["ffn down"] += layer.w_down.nbytes
    total["LM head"] = model.weights.lm_head.nbytes
    return total


class OpTimer:
    """Seconds and calls per operator family, accumulated by wrappers around a model's ops."""

    def __init__(self, model: Model):
        self.families = weight_families(model)
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def family(self, op: str, args: tuple) -> str:
        if op in ("linear", "qlinear"):  # args = (x, weight): the weight names the family
            return self.families.get(id(args[1]), "other linear")
        return OP_FAMILIES.get(op, op)

    def wrap(self, family_of: str | Callable[[tuple], str], fn: Callable) -> Callable:
        """``fn``, timed into ``family_of`` (a family name, or a function of the call's arguments)."""
        def timed(*args):
            start = time.perf_counter()
            out = fn(*args)
            seconds = time.perf_counter() - start
            family = family_of if isinstance(family_of, str) else family_of(args)
            self.seconds[family] += seconds
            self.calls[family] += 1
            return out
        return timed

    def backend(self, ops: Backend) -> Backend:
        """A backend whose every op is ``ops``' op, timed."""
        return Backend(f"timed {ops.name}",
                       {op: self.wrap(lambda args, op=op: self.family(op, args), getattr(ops, op)) for op in OPS})

    def model(self, model: Model) -> Model:
        """The same weights on the timed backend. (Its RoPE tables are built now, through the timer:
        ``clear`` before measuring.)"""
        return Model(model.config, model.weights, self.backend(model.ops))
