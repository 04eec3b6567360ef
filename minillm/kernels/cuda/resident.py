"""The resident CUDA backend: every op of the registry's contract, on arrays that stay on the GPU.

The host-wrapper backend (cuda/__init__.py) takes NumPy arrays and copies each op's inputs - the
weights included - to the device and its output back. This one takes and returns `DeviceTensor`s
(cuda/tensor.py) and weights already on the device (`DeviceTensor` for fp32, `GPUQMatrix` for
packed blocks; see model/device.py, which uploads a model once). So the one forward of
model/transformer.py runs unchanged, and the only host arrays an op still receives are the
batch's small integer arrays (token ids, positions, slot mapping, block tables, ...), which
live in the step's metadata. Those are uploaded once per forward: `once` remembers what it made
from the host arrays it was given, by their identity, until `begin_forward` (which the device
paged cache calls when a forward starts) forgets it - so 30 layers reading `meta.positions` cost
one copy, not 30.

The linear ops dispatch on how the weight is stored, since model/layers.py sends a weight that is
not a host QMatrix to `ops.linear` (and an embedding table to `ops.embedding`).
"""
from __future__ import annotations

import numpy as np

from minillm.kernels import reference
from minillm.kernels.cuda.contiguous_attention import attention_gpu, attention_scale, check_head_dim
from minillm.kernels.cuda.matmul_ladder import linear_gpu, matmul_gpu
from minillm.kernels.cuda.ops import (ELEMENTWISE_THREADS, embedding_gpu, rms_norm_gpu, rope_gpu, silu_gpu,
                                     softmax_gpu, swiglu_rows_kernel)
from minillm.kernels.cuda.paged_attention import paged_attention_gpu, write_kv_gpu
from minillm.kernels.cuda.quant import GPUQMatrix, qembedding_gpu, qlinear_gpu
from minillm.kernels.cuda.setup import blocks_for, empty_gpu, launch, to_gpu
from minillm.kernels.cuda.tensor import DeviceTensor
from minillm.kernels.registry import OPS, Backend

DeviceWeight = DeviceTensor | GPUQMatrix


class ResidentBackend(Backend):
    """The ops of OPS on device arrays, plus the per-forward upload of the batch's small arrays."""

    device = "cuda"

    def __init__(self):
        self._memo: dict[tuple, tuple[tuple, object]] = {}  # (what, ids of sources) -> (sources, result)
        super().__init__("cuda-resident", {op: getattr(self, "_" + op) for op in OPS})

    # ---- the batch's small arrays ------------------------------------------------------

    def begin_forward(self) -> None:
        """Forget the last forward's uploads: its metadata arrays are not this one's."""
        self._memo.clear()

    def once(self, what: str, sources: tuple[np.ndarray, ...], compute):
        """compute(), made once per forward for these host arrays (keyed by their identity; holding
        them keeps their ids from being reused while remembered)."""
        key = (what, *map(id, sources))
        if key not in self._memo:
            self._memo[key] = (sources, compute())
        return self._memo[key][1]

    def upload(self, host: np.ndarray, dtype) -> object:
        """The device copy of a host array, made once per forward."""
        return self.once(f"upload {np.dtype(dtype)}", (host,), lambda: to_gpu(host, dtype))

    # ---- the ops -----------------------------------------------------------------------

    def _matmul(self, a: DeviceTensor, b: DeviceTensor) -> DeviceTensor:
        return DeviceTensor(matmul_gpu(a.array, b.array))

    def _linear(self, x: DeviceTensor, w: DeviceWeight) -> DeviceTensor:
        """x (T, in) @ w.T -> (T, out), w fp32 or packed."""
        if isinstance(w, GPUQMatrix):
            return self._qlinear(x, w)
        if x.shape[0] == 0:
            return DeviceTensor.empty((0, w.shape[0]))
        return DeviceTensor(linear_gpu(x.array, w.array))

    def _qlinear(self, x: DeviceTensor, w: GPUQMatrix) -> DeviceTensor:
        if x.shape[0] == 0:
            return DeviceTensor.empty((0, w.shape[0]))
        return DeviceTensor(qlinear_gpu(x.array, w))

    def _embedding(self, ids: np.ndarray, table: DeviceWeight) -> DeviceTensor:
        if isinstance(table, GPUQMatrix):
            return self._qembedding(ids, table)
        return DeviceTensor(embedding_gpu(self.upload(ids, np.int64), table.array))

    def _qembedding(self, ids: np.ndarray, table: GPUQMatrix) -> DeviceTensor:
        return DeviceTensor(qembedding_gpu(self.upload(ids, np.int64), table))

    def _rms_norm(self, x: DeviceTensor, weight: DeviceTensor, eps: float) -> DeviceTensor:
        if x.shape[0] == 0:
            return DeviceTensor.empty(x.shape)
        return DeviceTensor(rms_norm_gpu(x.array, weight.array, eps))

    def _rope_table(self, head_dim: int, context_length: int, theta: float) -> tuple[DeviceTensor, DeviceTensor]:
        """Computed once per model on the host (not a kernel), then uploaded once."""
        return tuple(DeviceTensor.upload(t) for t in reference.rope_table(head_dim, context_length, theta))

    def _rope(self, x: DeviceTensor, positions: np.ndarray, cos: DeviceTensor, sin: DeviceTensor,
              style: str) -> DeviceTensor:
        """x (T, H, Dh), possibly a strided view, rotated in place -> x."""
        rope_gpu(x.array, self.upload(positions, np.int64), cos.array, sin.array, style)
        return x

    def _silu(self, x: DeviceTensor) -> DeviceTensor:
        return DeviceTensor(silu_gpu(x.contiguous().array.reshape(-1))).reshape(x.shape)

    def _swiglu(self, gate: DeviceTensor, up: DeviceTensor) -> DeviceTensor:
        """gate, up (T, F), possibly column slices of one (T, 2F) array -> (T, F)."""
        out = empty_gpu(gate.shape)
        n = gate.shape[0] * gate.shape[1]
        if n:
            launch(swiglu_rows_kernel[blocks_for(n, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS],
                   gate.array, up.array, out)
        return DeviceTensor(out)

    def _softmax(self, x: DeviceTensor) -> DeviceTensor:
        rows = x.reshape(-1, x.shape[-1])
        return DeviceTensor(softmax_gpu(rows.array)).reshape(x.shape)

    def _attention(self, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, start: int,
                   scale: float | None = None) -> DeviceTensor:
        check_head_dim(q.shape[2])
        return DeviceTensor(attention_gpu(q.array, k.array, v.array, start, attention_scale(q.shape[2], scale)))

    def _attention_decode(self, q: DeviceTensor, k: DeviceTensor, v: DeviceTensor, kv_len: int,
                          scale: float | None = None) -> DeviceTensor:
        out = self._attention(q.reshape(1, *q.shape), k, v, kv_len - 1, scale)  # (1, H, Dh)
        return out.reshape(*q.shape)

    def _write_kv(self, k_cache, v_cache, k: DeviceTensor, v: DeviceTensor, slot_mapping: np.ndarray) -> None:
        """k_cache, v_cache (num_blocks, block_size, Hkv, Dh) device arrays, written in place."""
        if len(slot_mapping):
            write_kv_gpu(k_cache, v_cache, k.array, v.array, self.upload(slot_mapping, np.int64))

    def _paged_attention_decode(self, q: DeviceTensor, k_cache, v_cache, block_tables: np.ndarray,
                                context_lens: np.ndarray, scale: float | None = None) -> DeviceTensor:
        """q (B, H, Dh): query b sees the first context_lens[b] keys of sequence b."""
        rows = self.once("decode rows", (context_lens,), lambda: (
            to_gpu(np.arange(len(context_lens)), np.int64), to_gpu(context_lens, np.int64), int(context_lens.max())))
        return self._paged(q, k_cache, v_cache, block_tables, rows, scale)

    def _paged_attention_prefill(self, q: DeviceTensor, k_cache, v_cache, block_tables: np.ndarray,
                                 query_starts: np.ndarray, context_lens: np.ndarray,
                                 scale: float | None = None) -> DeviceTensor:
        """q (N, H, Dh): the chunks of each sequence, causal (shapes.paged_prefill_rows' rule)."""
        def rows():
            query_lens = np.diff(query_starts)
            query_seq = np.repeat(np.arange(len(query_lens)), query_lens)  # (N,) the sequence of each query
            query_keys = context_lens[query_seq] + np.arange(len(query_seq)) - query_starts[query_seq] + 1  # (N,)
            return to_gpu(query_seq, np.int64), to_gpu(query_keys, np.int64), int(query_keys.max())

        return self._paged(q, k_cache, v_cache, block_tables, self.once("prefill rows", (query_starts, context_lens), rows),
                           scale)

    def _paged(self, q: DeviceTensor, k_cache, v_cache, block_tables: np.ndarray, rows, scale) -> DeviceTensor:
        query_seq, query_keys, max_keys = rows  # (N,), (N,) device arrays; the largest of query_keys
        check_head_dim(q.shape[2])
        out = paged_attention_gpu(q.array, k_cache, v_cache, self.upload(block_tables, np.int32), query_seq,
                                  query_keys, max_keys, attention_scale(q.shape[2], scale))
        return DeviceTensor(out)
