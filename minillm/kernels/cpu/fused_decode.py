"""A decode step's decoder layers in one compiled call: the per-op path's kernels, called from Numba.

The per-op forward (minillm/model/layers.py) calls about seven kernels a layer from Python, each
behind a wrapper that checks its arguments and picks a driver: for SmolLM2-135M some 200 calls a
decode step, ~0.84 ms of an ~8.8 ms step spent between them (benchmarks/results/
decode_profile.json, "other (Python glue)"), besides the checks counted in each op's own time.
For a decode-sized batch ``stack_kernel`` runs all the layers in one call, each as

    rms_norm -> qkv matvec -> (Qwen3: q/k RMSNorm) -> rope -> K/V write -> paged attention
             -> o matvec -> residual -> rms_norm -> gate/up matvec -> swiglu -> down matvec -> residual

by calling the very kernels the wrappers call (rows.py's serial drivers, the repacked matvec's
``matvec_rows_into`` of quant_fp32.py / quant_int8.py, paged_attention.py's write and attention
kernels) on the same values in the same order, so the logits are bit for bit the per-op path's.
Numba does not bounds-check: what the wrappers check on every call, ``DecodeStep`` checks once a
step (slots, block tables, positions: the batch) and ``layer_weights`` once a layer (the shapes).

A call per layer left ~30 calls a step from Python, each unboxing ~40 arguments: measured (2-core
Xeon VM, int8 mode, SmolLM2-135M) ~0.2 ms of a ~4 ms step under a profiler, and the interpreter
runs cold between layers that stream 2 MB of weights each. So the layers' weights travel as one
typed List per argument (``layer_runs``): one call unboxes them all. Consecutive layers whose
matrices share a code layout form a run, one call each (a file that quantizes some layers otherwise
takes a call per run).

Where it applies (the model decides, minillm/model/transformer.py): the numba backend's own
kernels, weights repacked for the SIMD matvec (exact or int8 activations), a host paged KV cache,
and at most ``REPACKED_MATVEC_ROWS_MAX_T`` rows - the range in which qlinear runs the matvec
kernel (a decode batch of up to 8 sequences, or a small speculative verify). Limits, as measured
choices rather than hidden ones: rms_norm and swiglu always run their serial drivers here (the
per-op wrappers switch to the parallel ones past ``PARALLEL_MIN_ELEMENTS`` floats, which a batch of
8 rows reaches only from a hidden size of 4096; the arithmetic is the same row function).

One kernel is compiled per (rows, each matrix's code layout, rows per group, activation mode, head
shape) on first use and cached on disk by Numba, as the matvec kernels are.
"""
from __future__ import annotations

import functools
import itertools
import math
import operator
import os

import numba
import numpy as np
from numba.extending import overload
from numba.typed import List

from minillm.kernels import cpu, shapes
from minillm.kernels.cpu import matmul_ladder, paged_attention, quant_fp32, quant_int8, quant_llvm, rows
from minillm.kernels.cpu.paged_attention import (
    key_chunks, paged_attention_kernel, paged_prefill_kernel, prefill_jobs, scatter_rows,
)
from minillm.kernels.cpu.quant import REPACKED_MATVEC_ROWS_MAX_T
from minillm.kernels.cpu.quant_repack import RepackedMatrix
from minillm.kernels.cpu.rows import rms_norm_serial, rope_serial, swiglu_serial
from minillm.kernels.cpu.variants import compile_variant

MAX_ROWS = REPACKED_MATVEC_ROWS_MAX_T  # beyond it qlinear runs other kernels: the per-op path runs
EXACT = -1  # the activation mode of exact (fp32) weights; int8 ones name their ISA (quant_int8.TARGET_ISA)

# Numba keys a cached function on its own source file only: a layer compiled into the disk cache
# would go on running the old code of a kernel edited since. So the stamps (as Numba's: mtime and
# size) of the files whose kernels it calls are part of each layer kernel's key.
KERNEL_SOURCES = tuple((os.stat(m.__file__).st_mtime, os.stat(m.__file__).st_size)
                       for m in (rows, matmul_ladder, paged_attention, quant_fp32, quant_int8, quant_llvm))

# The backend ops whose work the fused layer does; each must be the numba backend's own function.
FUSED_OPS = ("rms_norm", "qlinear", "rope", "swiglu", "paged_attention_decode", "paged_attention_prefill")


def uses_package_kernels(ops, cache_ops) -> bool:
    """Every op a layer calls (``ops``) and the cache's K/V write (``cache_ops``) is the numba
    backend's own: a learner's kernel, a timed wrapper or another backend keeps the per-op path."""
    return (all(getattr(ops, op, None) is getattr(cpu, op) for op in FUSED_OPS)
            and getattr(cache_ops, "write_kv", None) is cpu.write_kv)


# -----------------------------------------------------------------------------
# the compiled layer

def linear_rows_for(exact: bool):
    """linear_rows for one activation mode: x (T, cols) -> (T, rows) C-contiguous, by the kernel
    quant.qlinear runs for T <= MAX_ROWS (quant_fp32 or quant_int8 ``matvec_rows_into``).
    ``exact`` is a closure constant, so a compiled caller never compiles the other mode's kernel."""
    def linear_rows_impl(quants, scales, mins, x, rows, qtype_code, rows_per_group, tokens, isa):
        padded = -(-rows // rows_per_group) * rows_per_group
        out = np.empty((x.shape[0], padded), dtype=np.float32)  # (T, padded rows)
        if exact:
            quant_fp32.matvec_rows_into(quants, scales, mins, x, out, qtype_code, rows_per_group, tokens)
        else:
            quant_int8.matvec_rows_into(quants, scales, mins, x, out, qtype_code, rows_per_group, tokens, isa)
        return out if padded == rows else np.ascontiguousarray(out[:, :rows])

    return linear_rows_impl


def linear_rows(quants, scales, mins, x, rows, qtype_code, rows_per_group, tokens, isa):
    """The fused layer's linear. From Python (a test compares it with qlinear) each call retypes the
    kernel for its constants (milliseconds); in compiled code the overload below picks the mode."""
    return linear_rows_for(isa == EXACT)(quants, scales, mins, x, rows, qtype_code, rows_per_group, tokens, isa)


@overload(linear_rows, prefer_literal=True)
def _linear_rows_typed(quants, scales, mins, x, rows, qtype_code, rows_per_group, tokens, isa):
    """Chosen when the caller is compiled (Numba prunes a branch on a closure constant, not on a
    literal argument)."""
    return linear_rows_for(isa.literal_value == EXACT)


@functools.cache
def stack_kernel(tokens: int, codes: tuple[int, int, int, int], rows_per_group: int, isa: int,
                 head_shape: tuple[int, int]):
    """The compiled decoder layers of one run (consecutive layers whose weights share a kernel key)
    for ``tokens`` rows: the code layouts of (qkv, wo, gate_up, down) (quant_fp32.QTYPE_CODES), R,
    the activation mode (EXACT or an int8 ISA) and the attention's head_shape = (query heads per kv
    head, Dh). Constants, not arguments: the matvec and attention kernels unroll over them (and
    Numba keys its disk cache on them)."""
    qkv_code, wo_code, gate_up_code, down_code = codes
    group, attended_dim = head_shape
    sources = KERNEL_SOURCES  # a closure constant, so part of Numba's cache key (see KERNEL_SOURCES)

    def decoder_layers(x, attn_norms, qkv_qs, qkv_ss, qkv_ms, wo_qs, wo_ss, wo_ms, mlp_norms, gate_up_qs, gate_up_ss,
                       gate_up_ms, down_qs, down_ss, down_ms, q_norms, k_norms, first_layer, k_caches, v_caches,
                       n_heads, ffn, eps, positions, cos, sin, half_style, slot_mapping, by_rows, block_tables,
                       query_seq, query_keys, n_chunks, query_starts, context_lens, job_seq, job_t0, scale, out):
        """out (T, D) = x (T, D) through layers first_layer, first_layer + 1, ..., as
        layers.decoder_layer computes each; writes their K/V. The weights come one typed List per
        argument, an entry a layer (unboxed in one step: a call with every layer's arrays as
        arguments would unbox each). Into ``out``, not returned: a returned array is boxed through
        the function's environment, which Numba restores by name when it loads a variant from its
        disk cache; a run over a cache that several processes had filled failed there ("'descr' is
        NULL", benchmarks/speculative.py; Numba's index race, cpu/variants.py), and writing into
        ``out`` needs no environment.

        k_caches, v_caches (n_layers, num_blocks, block_size, Hkv, Dh); q_norms, k_norms (Dh,) or
        empty (Llama); the rest describes the batch (DecodeStep)."""
        sources  # noqa: B018 (only named, to key the cache)
        n_kv_heads, head_dim = k_caches.shape[3], k_caches.shape[4]
        model_dim, heads = x.shape[1], n_heads + 2 * n_kv_heads
        n_slots = k_caches.shape[1] * k_caches.shape[2]
        out[:] = x  # the hidden states from here on: a layer reads them before it overwrites them
        for i in range(len(attn_norms)):
            layer = first_layer + i
            # attention block
            normed = rms_norm_serial(out, attn_norms[i], eps)                                    # (T, D)
            qkv = linear_rows(qkv_qs[i], qkv_ss[i], qkv_ms[i], normed, heads * head_dim, qkv_code, rows_per_group,
                              tokens, isa).reshape(tokens, heads, head_dim)                    # (T, H + 2Hkv, Dh)
            if q_norms[i].shape[0]:  # Qwen3: RMSNorm over each head's vector, before RoPE
                q = rms_norm_serial(np.ascontiguousarray(qkv[:, :n_heads]).reshape(tokens * n_heads, head_dim),
                                    q_norms[i], eps).reshape(tokens, n_heads, head_dim)
                k = rms_norm_serial(np.ascontiguousarray(qkv[:, n_heads:n_heads + n_kv_heads]).reshape(
                    tokens * n_kv_heads, head_dim), k_norms[i], eps).reshape(tokens, n_kv_heads, head_dim)
                qk = np.concatenate((q, k), axis=1)                                            # (T, H + Hkv, Dh)
            else:
                qk = np.ascontiguousarray(qkv[:, :n_heads + n_kv_heads])                       # (T, H + Hkv, Dh)
            rope_serial(qk, positions, cos, sin, half_style)  # in place; positions checked by DecodeStep
            k_rows = np.ascontiguousarray(qk[:, n_heads:]).reshape(tokens, n_kv_heads * head_dim)  # (T, Hkv Dh)
            v_rows = np.ascontiguousarray(qkv[:, n_heads + n_kv_heads:]).reshape(tokens, n_kv_heads * head_dim)
            k_cache, v_cache = k_caches[layer], v_caches[layer]            # (num_blocks, block_size, Hkv, Dh)
            scatter_rows(k_cache.reshape(n_slots, n_kv_heads * head_dim), k_rows, slot_mapping)
            scatter_rows(v_cache.reshape(n_slots, n_kv_heads * head_dim), v_rows, slot_mapping)
            q = np.ascontiguousarray(qk[:, :n_heads])                                          # (T, H, Dh)
            attended = np.empty_like(q)                                                        # (T, H, Dh)
            if by_rows:
                paged_attention_kernel(q, k_cache, v_cache, block_tables, query_seq, query_keys, n_chunks, scale,
                                       attended, group, attended_dim)
            else:
                paged_prefill_kernel(q, k_cache, v_cache, block_tables, query_starts, context_lens, job_seq,
                                     job_t0, scale, attended, group, attended_dim)
            h = out + linear_rows(wo_qs[i], wo_ss[i], wo_ms[i], attended.reshape(tokens, n_heads * head_dim),
                                  model_dim, wo_code, rows_per_group, tokens, isa)               # (T, D)
            # MLP block
            normed = rms_norm_serial(h, mlp_norms[i], eps)                                     # (T, D)
            gate_up = linear_rows(gate_up_qs[i], gate_up_ss[i], gate_up_ms[i], normed, 2 * ffn, gate_up_code,
                                  rows_per_group, tokens, isa)                                 # (T, 2F)
            hidden = swiglu_serial(gate_up[:, :ffn], gate_up[:, ffn:])                         # (T, F)
            out[:] = h + linear_rows(down_qs[i], down_ss[i], down_ms[i], hidden, model_dim, down_code,
                                     rows_per_group, tokens, isa)

    return compile_variant(decoder_layers, T=tokens, codes=codes, R=rows_per_group, isa=isa, heads=head_shape)


# -----------------------------------------------------------------------------
# what Python checks: each layer's weights, then the batch once a step

NO_NORM = np.empty(0, dtype=np.float32)  # q_norm / k_norm of a model without QK-norm (Llama)


def layer_weights(attn_norm, qkv, wo, mlp_norm, gate_up, w_down, q_norm, k_norm,
                  dims: tuple[int, int, int, int, int]) -> tuple[tuple, tuple] | None:
    """(kernel key, kernel arguments) of one layer's weights, or None if the fused layer cannot
    run them: a matrix not repacked, or repacked otherwise than the others, or a shape other than
    dims = (D, H, Hkv, Dh, F) imply (the per-op path then runs and says what is wrong).
    ``qkv`` and ``gate_up`` are the stacked matrices (LayerWeights)."""
    model_dim, n_heads, n_kv_heads, head_dim, ffn = dims
    matrices = ((qkv, ((n_heads + 2 * n_kv_heads) * head_dim, model_dim)), (wo, (model_dim, n_heads * head_dim)),
                (gate_up, (2 * ffn, model_dim)), (w_down, (model_dim, ffn)))
    first = qkv
    for w, shape in matrices:
        if (type(w) is not RepackedMatrix or w.shape != shape or w.activations != first.activations
                or w.rows_per_group != first.rows_per_group):
            return None
    isa = quant_int8.TARGET_ISA if first.activations == "int8" else EXACT
    if isa != EXACT and any(quant_int8.rows_per_group_problem(w, isa) for w, _ in matrices):
        return None  # quant_int8.matvec_rows refuses it: let the per-op path say so
    norms = [(attn_norm, model_dim), (mlp_norm, model_dim)]
    if (q_norm is None) != (k_norm is None):
        return None
    if q_norm is not None:
        norms += [(q_norm, head_dim), (k_norm, head_dim)]
    for norm, size in norms:
        if not (isinstance(norm, np.ndarray) and norm.dtype == np.float32 and norm.shape == (size,)):
            return None
    key = (tuple(quant_fp32.QTYPE_CODES[w.qtype] for w, _ in matrices), first.rows_per_group, isa)
    arrays = (attn_norm, qkv.quants, qkv.scales, qkv.mins, wo.quants, wo.scales, wo.mins,
              mlp_norm, gate_up.quants, gate_up.scales, gate_up.mins, w_down.quants, w_down.scales, w_down.mins,
              NO_NORM if q_norm is None else q_norm, NO_NORM if k_norm is None else k_norm)
    return key, arrays


def layer_runs(layers: list[tuple[tuple, tuple]]) -> list[tuple[tuple, int, tuple]]:
    """``layer_weights`` of consecutive layers -> runs (kernel key, first layer, weights): the
    layers sharing a key, each argument's arrays in one typed List (an entry a layer)."""
    runs, first = [], 0
    for key, run in itertools.groupby(layers, key=operator.itemgetter(0)):
        columns = list(zip(*(arrays for _, arrays in run)))  # per argument: its array of each layer
        runs.append((key, first, tuple(typed_list(column) for column in columns)))
        first += len(columns[0])
    return runs


def typed_list(arrays: tuple[np.ndarray, ...]) -> List:
    """``List(arrays)`` for arrays of one type, built by compiled code that Numba caches on disk.
    From Python, a typed List compiles its methods for each item type afresh in every process:
    1.24 of the 1.59 s that SmolLM2's first token took in a new process with every kernel cached
    (cProfile; 2-core Zen 5 VM), paid again by every notebook kernel, server and test process."""
    first = arrays[0]
    return _list_builder(str(first.dtype), first.ndim, numba.typeof(first).layout, len(arrays))(tuple(arrays))


@functools.cache
def _list_builder(dtype: str, ndim: int, layout: str, length: int):
    """The builder for one item type and length, a variant of its own (cpu/variants.py)."""
    def build_list(arrays):
        out = List()
        for array in arrays:
            out.append(array)
        return out

    return compile_variant(build_list, dtype=dtype, ndim=ndim, layout=layout, n=length)


DECODE_SHAPES_CHECKED: set[tuple] = set()  # decode batches whose shapes passed the wrappers' checks (DecodeStep)


class DecodeStep:
    """One step's batch, checked once, and the layers run on it: ``run(x, layer, weights)``.

    Checks what write_kv, rope and the paged attention wrappers check on every call: the cache
    fits the model (n_layers, Hkv, Dh), the slots lie in it, the block tables name existing blocks
    and cover every key read, the positions index the RoPE tables. ``meta`` is a
    PagedAttentionMetadata; k_caches, v_caches the cache's (n_layers, num_blocks, block_size, Hkv,
    Dh) arrays; cos, sin the model's RoPE tables; dims = (D, H, Hkv, Dh, F) as in layer_weights.
    """

    def __init__(self, meta, k_caches: np.ndarray, v_caches: np.ndarray, num_layers: int, cos: np.ndarray,
                 sin: np.ndarray, rope_style: str, eps: float, dims: tuple[int, int, int, int, int]):
        _, n_heads, n_kv_heads, head_dim, ffn = dims
        tokens = meta.num_tokens
        if not 1 <= tokens <= MAX_ROWS:
            raise ValueError(f"a fused decode step runs 1..{MAX_ROWS} rows, got {tokens}")
        if k_caches.ndim != 5 or k_caches.shape[0] < num_layers:
            raise ValueError(f"the KV cache {k_caches.shape} does not hold (n_layers >= {num_layers}, num_blocks, "
                             f"block_size, Hkv, Dh) arrays")
        # the attention kernel as the per-op path chooses it: PagedKVCache.attend's decode kernel for
        # one query a sequence, paged_attention_prefill's rows for a few (a verify), else its tiles
        decode = bool((meta.query_lens == 1).all())
        self.by_rows = decode or paged_attention.attends_by_rows(meta.query_lens)
        if decode:
            query_keys = meta.context_lens + 1  # (B,) keys each query sees, its own included
            num_blocks, block_size = k_caches.shape[1], k_caches.shape[2]
            shape = (tokens, dims, rope_style, k_caches.shape, v_caches.shape, k_caches.dtype, v_caches.dtype,
                     k_caches.flags.c_contiguous, v_caches.flags.c_contiguous, cos.shape, sin.shape,
                     meta.block_tables.shape[0], meta.block_tables.ndim, meta.block_tables.dtype,
                     meta.slot_mapping.dtype)
            # every step: the values, in one compiled pass; the wrappers' checks only for a new
            # shape, or to name what is wrong (they cost ~9 us of NumPy reductions, ~3x that in a
            # step, after the weights have pushed the interpreter out of the CPU caches)
            if shape not in DECODE_SHAPES_CHECKED or not shapes.decode_values_fit(
                    meta.slot_mapping, num_blocks * block_size, meta.positions, len(cos), meta.block_tables,
                    query_keys, block_size, num_blocks):
                self._check_as_the_wrappers_do(meta, k_caches, v_caches, cos, sin, rope_style, dims, decode)
                DECODE_SHAPES_CHECKED.add(shape)
            tables, query_seq = meta.block_tables, np.arange(tokens)
        else:
            tables, query_seq, query_keys = self._check_as_the_wrappers_do(meta, k_caches, v_caches, cos, sin,
                                                                           rope_style, dims, decode)
        if self.by_rows:
            n_chunks, jobs = key_chunks(tokens, n_kv_heads, query_keys), (np.empty(0, np.int64),) * 2
        else:
            n_chunks, jobs = 1, prefill_jobs(meta.query_starts, meta.context_lens)
        self.tokens, self.k_caches, self.v_caches = tokens, k_caches, v_caches
        self.head_shape = (n_heads // n_kv_heads, head_dim)
        # the batch's part of every layer's arguments, in decoder_layer's order
        self.batch = (n_heads, ffn, np.float32(eps), meta.positions, cos, sin, rope_style == "half",
                      meta.slot_mapping, self.by_rows, np.ascontiguousarray(tables, dtype=np.int32),
                      query_seq.astype(np.int64, copy=False), query_keys.astype(np.int64, copy=False), n_chunks,
                      meta.query_starts, meta.context_lens, *jobs, np.float32(1 / math.sqrt(head_dim)))

    def _check_as_the_wrappers_do(self, meta, k_caches, v_caches, cos, sin, rope_style, dims, decode: bool):
        """What write_kv, rope and the paged attention wrapper check, on stand-ins of the shapes the
        layers pass them -> the attention kernel's (block_tables, query_seq, query_keys)."""
        _, n_heads, n_kv_heads, head_dim, _ = dims
        tokens = meta.num_tokens
        q_probe = np.empty((tokens, n_heads, head_dim), dtype=np.float32)          # (T, H, Dh)
        kv_probe = np.empty((tokens, n_kv_heads, head_dim), dtype=np.float32)      # (T, Hkv, Dh)
        shapes.check_write_kv(k_caches[0], v_caches[0], kv_probe, kv_probe, meta.slot_mapping)
        shapes.check_contiguous_cache(k_caches, v_caches)
        shapes.check_rope(np.empty((tokens, n_heads + n_kv_heads, head_dim), dtype=np.float32), meta.positions,
                          cos, sin, rope_style)
        if decode:
            return shapes.paged_decode_rows(q_probe, k_caches[0], v_caches[0], meta.block_tables,
                                            meta.context_lens + 1)
        return shapes.paged_prefill_rows(q_probe, k_caches[0], v_caches[0], meta.block_tables, meta.query_starts,
                                         meta.context_lens)

    def run(self, x: np.ndarray, runs: list[tuple[tuple, int, tuple]]) -> np.ndarray:
        """The layers of ``runs`` (``layer_runs``) on the hidden states x (T, D) -> (T, D): one
        compiled call a run, one a step for a model whose layers share a code layout."""
        for (codes, rows_per_group, isa), first_layer, weights in runs:
            kernel = stack_kernel(self.tokens, codes, rows_per_group, isa, self.head_shape)
            out = np.empty_like(x)  # (T, D)
            kernel(x, *weights, first_layer, self.k_caches, self.v_caches, *self.batch, out)
            x = out
        return x
