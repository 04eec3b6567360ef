"""Paged attention: attention over keys and values scattered in fixed-size blocks.

The paged KV cache stores, per layer, K and V each as (num_blocks, block_size, Hkv, Dh). A
sequence's keys are not contiguous: its *block table* lists the physical blocks holding its
tokens 0..bs-1, bs..2bs-1, ... in order, so token t lives at

    block_tables[b, t // bs], offset t % bs      (its "slot" is block * bs + offset)

Attention itself is unchanged - only the address of key t is one table lookup away. The NumPy
specification (reference.paged_attention_decode / _prefill) gathers the blocks into a contiguous
buffer and calls the contiguous attention; these Numba kernels walk the block table in place:

    write_kv                  scatter a batch's new K/V into their slots (a compiled row copy)
    paged_attention_decode    one query per sequence over its blocks
    paged_attention_prefill   a chunk of new queries per sequence, on top of a cached prefix,
                              causal within the chunk: tiles of queries against tiles of keys
                              (a few queries a sequence, as a speculative verify brings, run
                              as decode rows: ``attends_by_rows``)

Decode runs one kernel in which each query row knows its sequence and how many keys it sees,
its inner loops written as vector IR and compiled once per head shape (group, Dh); prefill has
its own, tiled as two matmuls. Grouped-query attention indexes the shared KV head
(h // group) rather than repeating K/V. Numba does not bounds-check, so every wrapper checks
shapes, dtypes, lengths and block ids first (shapes.py, shared with the reference and CUDA).
"""
from __future__ import annotations

import functools
import math

import numba
import numpy as np
from numba import literally, njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from minillm.hardware.machine import compile_target
from minillm.kernels import shapes
from minillm.kernels.cpu import quant_llvm as L
from minillm.kernels.cpu.rows import KERNEL, LANES, ORDERED, fast_exp, fixed_order_sum, float32_max, row_max
from minillm.kernels.cpu.variants import compile_variant

# -----------------------------------------------------------------------------
# writing: a scatter through the slot mapping


def write_kv(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray, slot_mapping: np.ndarray) -> None:
    """Numba version of reference.write_kv: k, v (N, Hkv, Dh) into their slots (N,), in place.

    Seen as (num_blocks * block_size, Hkv, Dh) the cache has one row per slot, so the write is a
    row copy per slot. NumPy's fancy-index scatter did it at 0.4 GB/s (2 ms for a 512-token
    SmolLM2 chunk, 2-core Zen 4), a compiled loop of row copies 20x faster.
    """
    slot_mapping = np.asarray(slot_mapping)
    shapes.check_write_kv(k_cache, v_cache, k, v, slot_mapping)
    shapes.check_contiguous_cache(k_cache, v_cache)
    num_blocks, block_size, n_kv_heads, head_dim = k_cache.shape
    scatter_rows(k_cache.reshape(num_blocks * block_size, n_kv_heads * head_dim),  # (num_slots, Hkv*Dh) view
                 np.ascontiguousarray(k, dtype=np.float32).reshape(len(slot_mapping), -1), slot_mapping.astype(np.int64))
    scatter_rows(v_cache.reshape(num_blocks * block_size, n_kv_heads * head_dim),
                 np.ascontiguousarray(v, dtype=np.float32).reshape(len(slot_mapping), -1), slot_mapping.astype(np.int64))


@njit(**KERNEL)
def scatter_rows(table, rows, slots):
    """table[slots[i]] = rows[i] for every i. table (num_slots, W); rows (N, W); slots (N,) checked."""
    for i in range(len(slots)):
        table[slots[i], :] = rows[i]


# -----------------------------------------------------------------------------
# decode: one query per sequence, walking the block table in place
#
# A job is (query row, kv head, chunk of keys): it reads each key and value row once for all the
# query heads sharing that kv head (GQA), and leaves per head a running max m, a sum l of
# exp(score - m) and an unnormalised output acc. A second pass merges the chunks of each head,
# rescaling each by exp(m_chunk - m_all). Long decodes are split into chunks so that a batch of
# one sequence still has a job for every core (flash-decoding); prefill has rows enough.
#
# The two halves of a job that touch the cache are written as LLVM vector IR (cpu/quant_llvm.py),
# unrolled over the group of query heads and the head's vectors (compile-time constants):
#
#   _key_scores       per key: Dh / LANES vector loads, group x Dh / LANES FMAs against the
#                     queries held in registers, one horizontal sum per head (a shuffle tree)
#   _weighted_values  per key: Dh / LANES vector loads, group x Dh / LANES FMAs into
#                     accumulators held in registers for the whole job
#
# The plain Numba loops they replace (the same arithmetic) kept the accumulators in memory and
# compiled the 64-term dots into scalar code around a short vector loop. Kernel alone, old and new
# alternated in one process (SmolLM2's 9 heads over 3 kv heads, one layer, 2-core Zen 4, AVX-512,
# medians): one sequence of 150 keys 15.6 -> 7.5 us, of 600 keys 42 -> 19 us, 8 of 300 keys
# 150 -> 63 us; 64 sequences of 100-400 keys 2.0 -> 0.7-1.4 ms, where the 25 MB of K/V it reads
# from memory bound it (18-34 GB/s on this VM).

SPLIT_MIN_KEYS = 256  # a chunk covers at least this many keys, or merging costs more than it saves


def _lanes(head_dim: int) -> int:
    """Floats per vector of a head's row: 16 where Dh allows, else the largest power of two dividing it."""
    return math.gcd(head_dim, 16)


def _tree_sum(builder, v):
    """The lanes of v added pairwise (halves, then quarters...): log2(lanes) shuffles and adds."""
    while v.type.count > 1:
        half = v.type.count // 2
        v = builder.fadd(L.pick(builder, v, v, range(half)), L.pick(builder, v, v, range(half, 2 * half)))
    return L.lane(builder, v, 0)


def _for_each_key(builder, table_ptr, s0, s1, block_size, row_of, body):
    """body(key offset from s0, element offset of the key's row) for keys s0..s1-1 of a sequence,
    block by block: one division a job, not one a key. row_of(block, offset in block) -> the row's
    element offset in the cache."""
    first_block = builder.sdiv(s0, block_size)
    end_block = builder.sdiv(builder.add(s1, builder.sub(block_size, L.index(1))), block_size)
    with cgutils.for_range_slice(builder, first_block, end_block, L.index(1)) as (block_index, _):
        block = builder.sext(builder.load(builder.gep(table_ptr, [block_index])), L.I64)
        first = builder.mul(block_index, block_size)                            # token of the block's row 0
        lo = builder.select(builder.icmp_signed(">", s0, first), s0, first)
        block_end = builder.add(first, block_size)
        hi = builder.select(builder.icmp_signed("<", s1, block_end), s1, block_end)
        with cgutils.for_range_slice(builder, lo, hi, L.index(1)) as (t, _):
            body(builder.sub(t, s0), row_of(block, builder.sub(t, first)))


def _cache_rows(context, builder, cache_type, cache, kv_head):
    """(pointer to the cache's data, block size, row_of) for a C-contiguous (num_blocks, bs, Hkv, Dh)
    cache: row_of(block, offset) is the element offset of (block, offset, kv_head, 0)."""
    data = L.array_data(context, builder, cache_type, cache)
    block_size, n_kv_heads, head_dim = (L.array_shape(context, builder, cache_type, cache, d) for d in (1, 2, 3))
    row = builder.mul(n_kv_heads, head_dim)                                     # floats per slot

    def row_of(block, offset):
        slot = builder.add(builder.mul(block, block_size), offset)
        return builder.add(builder.mul(slot, row), builder.mul(kv_head, head_dim))
    return data, block_size, row_of


def _head_constants(group, head_dim):
    if not all(isinstance(c, types.IntegerLiteral) for c in (group, head_dim)):
        return None
    G, Dh = group.literal_value, head_dim.literal_value
    return G, Dh, _lanes(Dh)


@intrinsic
def _key_scores(typingctx, queries, k_cache, table, kv_head, s0, s1, scores, group, head_dim):
    """scores[g, t - s0] = queries[g] . key t for keys s0..s1-1 of the sequence whose blocks
    ``table`` lists: queries (group, Dh), scores (group, s1 - s0), both C-contiguous float32;
    k_cache C-contiguous (num_blocks, bs, Hkv, Dh). group, Dh compile-time constants; nothing checked.

    Measured (2-core Xeon VM, one thread, one job of 1000 keys, 3 query heads of 64): the scores
    5.5 ns a key, the softmax's exps and sums 1.7, the weighted values 3.9 - the horizontal sum
    of each key and head is most of the first. Summing four keys' partial sums together (two
    shuffles and an add per pair, the very additions of _tree_sum: bit for bit the same scores)
    took the scores to 3.7 ns, but the whole kernel on two threads only 3-5% (the keys and values
    stream from L2 and L3 there), and AVX2 code lost 4-6% (its shuffles cross 128-bit lanes): not kept."""
    constants = _head_constants(group, head_dim)
    if constants is None or k_cache.layout != "C":
        return None
    G, Dh, lanes = constants
    n_vectors = Dh // lanes

    def codegen(context, builder, sig, args):
        q_ptr = L.array_data(context, builder, sig.args[0], args[0])
        table_ptr = L.array_data(context, builder, sig.args[2], args[2])
        out_ptr = L.array_data(context, builder, sig.args[6], args[6])
        kv_head, s0, s1 = args[3], args[4], args[5]
        k_ptr, block_size, row_of = _cache_rows(context, builder, sig.args[1], args[1], kv_head)
        vec = L.vector(L.F32, lanes)
        n_keys = builder.sub(s1, s0)
        q = [[L.load(builder, q_ptr, L.index(g * Dh + c * lanes), vec) for c in range(n_vectors)]
             for g in range(G)]                                                 # G x Dh/lanes, in registers

        def score_key(j, row):
            key = [L.load(builder, k_ptr, builder.add(row, L.index(c * lanes)), vec) for c in range(n_vectors)]
            for g in range(G):
                dot = builder.fmul(q[g][0], key[0])
                for c in range(1, n_vectors):
                    dot = L.fma(builder, q[g][c], key[c], dot)                  # (lanes,) partial sums
                at = builder.add(builder.mul(L.index(g), n_keys), j)
                builder.store(_tree_sum(builder, dot), builder.gep(out_ptr, [at]))

        _for_each_key(builder, table_ptr, s0, s1, block_size, row_of, score_key)
        return context.get_dummy_value()

    return types.void(queries, k_cache, table, kv_head, s0, s1, scores, group, head_dim), codegen


@intrinsic
def _weighted_values(typingctx, weights, v_cache, table, kv_head, s0, s1, acc, group, head_dim):
    """acc[g] = sum over keys t of weights[g, t - s0] * value t, for keys s0..s1-1: weights
    (group, s1 - s0), acc (group, Dh) C-contiguous float32, v_cache as k_cache in _key_scores."""
    constants = _head_constants(group, head_dim)
    if constants is None or v_cache.layout != "C":
        return None
    G, Dh, lanes = constants
    n_vectors = Dh // lanes

    def codegen(context, builder, sig, args):
        w_ptr = L.array_data(context, builder, sig.args[0], args[0])
        table_ptr = L.array_data(context, builder, sig.args[2], args[2])
        acc_ptr = L.array_data(context, builder, sig.args[6], args[6])
        kv_head, s0, s1 = args[3], args[4], args[5]
        v_ptr, block_size, row_of = _cache_rows(context, builder, sig.args[1], args[1], kv_head)
        vec = L.vector(L.F32, lanes)
        n_keys = builder.sub(s1, s0)
        sums = [[L.accumulator(builder, L.constant_vector(L.F32, [0.0] * lanes)) for _ in range(n_vectors)]
                for _ in range(G)]                                              # G x Dh/lanes registers

        def add_value(j, row):
            value = [L.load(builder, v_ptr, builder.add(row, L.index(c * lanes)), vec) for c in range(n_vectors)]
            for g in range(G):
                p = L.splat(builder, builder.load(builder.gep(w_ptr, [builder.add(builder.mul(L.index(g), n_keys), j)])),
                            lanes)
                for c in range(n_vectors):
                    builder.store(L.fma(builder, p, value[c], builder.load(sums[g][c])), sums[g][c])

        _for_each_key(builder, table_ptr, s0, s1, block_size, row_of, add_value)
        for g in range(G):
            for c in range(n_vectors):
                L.store(builder, acc_ptr, L.index(g * Dh + c * lanes), builder.load(sums[g][c]))
        return context.get_dummy_value()

    return types.void(weights, v_cache, table, kv_head, s0, s1, acc, group, head_dim), codegen


@njit(**ORDERED)
def _attend_chunk(q, k_cache, v_cache, table, i, kv_head, s0, s1, scale, m_out, l_out, acc_out, group, head_dim):
    """Query row i's heads of kv_head over keys s0..s1-1 of one sequence: per head m, l and acc.

    q (N, H, Dh); k_cache, v_cache (num_blocks, bs, Hkv, Dh); table (max_blocks,) the sequence's
    blocks; m_out, l_out (group,); acc_out (group, Dh). An empty chunk leaves m = -inf, l = 0.
    """
    h0 = kv_head * group                                         # the first query head of this kv head
    queries = np.empty((group, head_dim), dtype=np.float32)     # (group, Dh) pre-scaled
    for g in range(group):
        for d in range(head_dim):
            queries[g, d] = q[i, h0 + g, d] * scale
    scores = np.empty((group, s1 - s0), dtype=np.float32)       # (group, keys) scores, then weights
    _key_scores(queries, k_cache, table, kv_head, s0, s1, scores, group, head_dim)
    for g in range(group):
        row = scores[g]
        m = row_max(row)
        for j in range(row.shape[0]):
            row[j] = fast_exp(row[j] - m)                        # in (0, 1]: the max was subtracted
        m_out[g], l_out[g] = m, fixed_order_sum(row)             # an empty chunk: -inf and 0
    _weighted_values(scores, v_cache, table, kv_head, s0, s1, acc_out, group, head_dim)


# Not cached on disk: its variants (one per head shape) would share one index (cpu/variants.py).
# Its callers are, each variant under its own name (``decode_kernel`` below, cpu/fused_decode.py).
@njit(parallel=True, fastmath=ORDERED["fastmath"], error_model="numpy")
def paged_attention_kernel(q, k_cache, v_cache, block_tables, query_seq, query_keys, n_chunks, scale, out,
                           group, head_dim):
    """out[i, h] = softmax(scale q[i, h] . K) V over the first query_keys[i] keys of sequence query_seq[i].

    q, out (N, H, Dh); k_cache, v_cache C-contiguous; block_tables (B, max_blocks) int32;
    query_seq, query_keys (N,) int64; group (= H / Hkv) and Dh compile-time constants.
    """
    literally(group)
    literally(head_dim)
    n_queries, n_heads = q.shape[0], q.shape[1]
    n_kv_heads = k_cache.shape[2]
    m = np.empty((n_queries, n_kv_heads, n_chunks, group), dtype=np.float32)      # running maxima
    l = np.empty((n_queries, n_kv_heads, n_chunks, group), dtype=np.float32)      # sums of weights
    acc = np.empty((n_queries, n_kv_heads, n_chunks, group, head_dim), dtype=np.float32)  # outputs
    for job in prange(n_queries * n_kv_heads * n_chunks):
        i, rest = job // (n_kv_heads * n_chunks), job % (n_kv_heads * n_chunks)
        kv_head, c = rest // n_chunks, rest % n_chunks
        n = query_keys[i]
        s0, s1 = c * n // n_chunks, (c + 1) * n // n_chunks  # the last chunk is never empty
        _attend_chunk(q, k_cache, v_cache, block_tables[query_seq[i]], i, kv_head, s0, s1, scale,
                      m[i, kv_head, c], l[i, kv_head, c], acc[i, kv_head, c], group, head_dim)
        if n_chunks == 1:                              # nothing to merge: normalise here
            for g in range(group):
                for d in range(head_dim):
                    out[i, kv_head * group + g, d] = acc[i, kv_head, 0, g, d] / l[i, kv_head, 0, g]
    if n_chunks == 1:                                  # (a second parallel loop costs a fork and a join)
        return
    for job in prange(n_queries * n_heads):            # merge the chunks of each head
        i, h = job // n_heads, job % n_heads
        kv_head, g = h // group, h % group
        m_all = np.float32(-np.inf)
        for c in range(n_chunks):
            m_all = float32_max(m_all, m[i, kv_head, c, g])
        total = np.float32(0.0)
        out[i, h, :] = 0.0
        for c in range(n_chunks):
            w = fast_exp(m[i, kv_head, c, g] - m_all)  # rescale the chunk to the common max
            total += w * l[i, kv_head, c, g]
            for d in range(head_dim):
                out[i, h, d] += w * acc[i, kv_head, c, g, d]
        for d in range(head_dim):
            out[i, h, d] /= total


@functools.cache
def decode_kernel(group: int, head_dim: int):
    """paged_attention_kernel for one head shape, as a function of the arrays alone, compiled on
    first use and cached on disk (cpu/variants.py)."""
    def attention_kernel(q, k_cache, v_cache, block_tables, query_seq, query_keys, n_chunks, scale, out):
        paged_attention_kernel(q, k_cache, v_cache, block_tables, query_seq, query_keys, n_chunks, scale, out,
                               group, head_dim)

    return compile_variant(attention_kernel, group=group, head_dim=head_dim)


# -----------------------------------------------------------------------------
# prefill: the same online softmax, but tiles of queries against tiles of keys, as two matmuls
#
# The per-row kernel above computes one dot product at a time, each ending in a horizontal sum:
# 24 GFLOP/s on a 512-token SmolLM2 prefill (2-core Zen 4), a quarter of the prompt's time. Here
# a job holds a tile of queries of one kv head - PREFILL_QUERY_TILE tokens x its group of query
# heads, stacked as rows - and walks the sequence's keys PREFILL_KEY_TILE at a time: scores =
# Q K^T, then acc = acc * alpha + P V, each a register-tiled matmul written as vector IR
# (_tile_scores, _tile_values): a micro-tile of TILE_ROWS rows x TILE_VECTORS vectors of
# accumulators stays in registers while the shared dimension streams past, each loaded vector
# of keys (values) feeding TILE_ROWS broadcast FMAs. The keys are gathered transposed, so that
# a row of the tile's scores is whole vectors; the values are read in place from their blocks.
#
# Measured (one SmolLM2 layer, a 512-token prompt, 2 threads, 2-core Xeon VM; old and new
# alternated in one process, medians of 41): 5.2 -> 2.3 ms with AVX-512 code, 5.2 -> 3.4 ms with
# AVX2 code. The old kernel ran both products as the 4 x 4 tiles of dot products of
# cpu/matmul_ladder.py (16 horizontal sums a tile: at Dh = 64 they cost as much as the FMAs).
# The largest part left is the softmax's exps (LLVM vectorises them with 256-bit registers here).

PREFILL_QUERY_TILE = 32  # query tokens per job (x group heads = rows of the score tile)
PREFILL_KEY_TILE = 64    # keys per step: the transposed key tile (16 KB at Dh = 64) stays in L1
TILE_VECTORS = 4                                     # vectors of a row a micro-tile covers
# rows of a micro-tile: its TILE_ROWS x TILE_VECTORS accumulators, the loaded vectors and a
# broadcast must fit the registers: 32 on AVX-512, 16 on AVX2 (AArch64's 32 could take more rows;
# not measured, so its targets get AVX2's tile)
TILE_ROWS = 6 if compile_target().vector_bits == 512 else 3


def _micro_tiles(builder, n_rows, n_vectors, body):
    """body(first row, vector columns) for each TILE_ROWS x (<= TILE_VECTORS) micro-tile of an
    (n_rows, n_vectors) block; n_rows (runtime) a multiple of TILE_ROWS."""
    with cgutils.for_range_slice(builder, L.index(0), n_rows, L.index(TILE_ROWS)) as (r0, _):
        for c0 in range(0, n_vectors, TILE_VECTORS):
            body(r0, range(c0, min(c0 + TILE_VECTORS, n_vectors)))


@intrinsic
def _tile_scores(typingctx, queries, keys_t, scores):
    """scores (R, BK) = queries (R, Dh) @ keys_t (Dh, BK), BK = PREFILL_KEY_TILE, R a multiple of
    TILE_ROWS; all C-contiguous float32. Nothing checked."""
    n_vectors = PREFILL_KEY_TILE // LANES

    def codegen(context, builder, sig, args):
        q_ptr, k_ptr, s_ptr = (L.array_data(context, builder, sig.args[i], args[i]) for i in range(3))
        n_rows, head_dim = (L.array_shape(context, builder, sig.args[0], args[0], d) for d in (0, 1))
        vec = L.vector(L.F32, LANES)
        zero = L.constant_vector(L.F32, [0.0] * LANES)
        acc = [[L.accumulator(builder, zero) for _ in range(TILE_VECTORS)] for _ in range(TILE_ROWS)]

        def micro_tile(r0, columns):
            for i in range(TILE_ROWS):
                for c in range(len(columns)):
                    builder.store(zero, acc[i][c])
            with cgutils.for_range(builder, head_dim) as loop:                 # the shared dimension
                d = loop.index
                row = builder.mul(d, L.index(PREFILL_KEY_TILE))
                keys = [L.load(builder, k_ptr, builder.add(row, L.index(col * LANES)), vec) for col in columns]
                for i in range(TILE_ROWS):
                    at = builder.add(builder.mul(builder.add(r0, L.index(i)), head_dim), d)
                    query = L.splat(builder, builder.load(builder.gep(q_ptr, [at])), LANES)
                    for c in range(len(columns)):
                        builder.store(L.fma(builder, query, keys[c], builder.load(acc[i][c])), acc[i][c])
            for i in range(TILE_ROWS):
                row = builder.mul(builder.add(r0, L.index(i)), L.index(PREFILL_KEY_TILE))
                for c, col in enumerate(columns):
                    L.store(builder, s_ptr, builder.add(row, L.index(col * LANES)), builder.load(acc[i][c]))

        _micro_tiles(builder, n_rows, n_vectors, micro_tile)
        return context.get_dummy_value()

    return types.void(queries, keys_t, scores), codegen


@intrinsic
def _tile_values(typingctx, weights, v_cache, table, kv_head, s0, s1, alpha, acc, head_dim):
    """acc (R, Dh) = acc * alpha[:, None] + weights[:, :s1 - s0] @ (values s0..s1-1 of the sequence
    whose blocks ``table`` lists): weights (R, BK), alpha (R,), R a multiple of TILE_ROWS; v_cache
    C-contiguous (num_blocks, bs, Hkv, Dh); Dh a compile-time constant. Nothing checked."""
    if not isinstance(head_dim, types.IntegerLiteral) or v_cache.layout != "C":
        return None
    Dh = head_dim.literal_value
    lanes = math.gcd(Dh, LANES)

    def codegen(context, builder, sig, args):
        w_ptr, table_ptr, alpha_ptr, acc_ptr = (L.array_data(context, builder, sig.args[i], args[i])
                                                for i in (0, 2, 6, 7))
        kv_head, s0, s1 = args[3], args[4], args[5]
        n_rows = L.array_shape(context, builder, sig.args[0], args[0], 0)
        v_ptr, block_size, row_of = _cache_rows(context, builder, sig.args[1], args[1], kv_head)
        vec = L.vector(L.F32, lanes)
        sums = [[L.accumulator(builder, L.constant_vector(L.F32, [0.0] * lanes)) for _ in range(TILE_VECTORS)]
                for _ in range(TILE_ROWS)]

        def micro_tile(r0, columns):
            rows = [builder.add(r0, L.index(i)) for i in range(TILE_ROWS)]
            for i, r in enumerate(rows):                                        # acc * alpha, into registers
                scale = L.splat(builder, builder.load(builder.gep(alpha_ptr, [r])), lanes)
                for c, col in enumerate(columns):
                    at = builder.add(builder.mul(r, L.index(Dh)), L.index(col * lanes))
                    builder.store(builder.fmul(L.load(builder, acc_ptr, at, vec), scale), sums[i][c])

            def add_value(j, row):                                              # key j of the tile
                values = [L.load(builder, v_ptr, builder.add(row, L.index(col * lanes)), vec) for col in columns]
                for i, r in enumerate(rows):
                    at = builder.add(builder.mul(r, L.index(PREFILL_KEY_TILE)), j)
                    weight = L.splat(builder, builder.load(builder.gep(w_ptr, [at])), lanes)
                    for c in range(len(columns)):
                        builder.store(L.fma(builder, weight, values[c], builder.load(sums[i][c])), sums[i][c])

            _for_each_key(builder, table_ptr, s0, s1, block_size, row_of, add_value)
            for i, r in enumerate(rows):
                for c, col in enumerate(columns):
                    at = builder.add(builder.mul(r, L.index(Dh)), L.index(col * lanes))
                    L.store(builder, acc_ptr, at, builder.load(sums[i][c]))

        _micro_tiles(builder, n_rows, Dh // lanes, micro_tile)
        return context.get_dummy_value()

    return types.void(weights, v_cache, table, kv_head, s0, s1, alpha, acc, head_dim), codegen


@njit(**ORDERED)
def _prefill_job(q, k_cache, v_cache, table, first_row, context_len, t0, t1, kv_head, scale, out, group, head_dim):
    """Queries t0..t1-1 (chunk-relative) of one sequence, the heads of kv_head -> out rows."""
    block_size = k_cache.shape[1]
    n_rows = (t1 - t0) * group                                       # row r: token t0 + r // group, head r % group
    padded = -(-n_rows // TILE_ROWS) * TILE_ROWS                     # whole micro-tiles; the extra rows stay 0
    qs = np.zeros((padded, head_dim), dtype=np.float32)              # (R, Dh) queries, pre-scaled
    for r in range(n_rows):
        for d in range(head_dim):
            qs[r, d] = q[first_row + t0 + r // group, kv_head * group + r % group, d] * scale
    kt = np.zeros((head_dim, PREFILL_KEY_TILE), dtype=np.float32)   # (Dh, BK) keys of this step, transposed
    s = np.zeros((padded, PREFILL_KEY_TILE), dtype=np.float32)      # (R, BK) scores, then weights
    acc = np.zeros((padded, head_dim), dtype=np.float32)            # (R, Dh) unnormalised outputs
    m = np.full(padded, -np.inf, dtype=np.float32)                  # (R,) running max
    l = np.zeros(padded, dtype=np.float32)                          # (R,) running sum of weights
    alpha = np.ones(padded, dtype=np.float32)                       # (R,) this step's rescaling of acc
    last_key = context_len + t1                                     # keys 0..last_key-1 are seen
    for k0 in range(0, last_key, PREFILL_KEY_TILE):
        nk = min(PREFILL_KEY_TILE, last_key - k0)
        for j in range(nk):                                         # gather (columns past nk: never weighted)
            token = k0 + j
            block, offset = table[token // block_size], token % block_size
            for d in range(head_dim):
                kt[d, j] = k_cache[block, offset, kv_head, d]
        _tile_scores(qs, kt, s)                                     # (R, BK) = Q K^T
        for r in range(n_rows):
            visible = min(nk, context_len + t0 + r // group - k0 + 1)  # causal: keys up to its position
            row = s[r]
            if visible <= 0:                                        # the whole tile lies in its future
                row[:] = 0.0
                alpha[r] = 1.0
                continue
            for j in range(visible, PREFILL_KEY_TILE):              # -inf: weight exactly 0; the loops
                row[j] = -np.inf                                    # below then run whole vectors
            new_m = float32_max(m[r], row_max(row))
            alpha[r] = fast_exp(m[r] - new_m)                       # 0 on the row's first tile
            for j in range(PREFILL_KEY_TILE):
                row[j] = fast_exp(row[j] - new_m)
            l[r] = l[r] * alpha[r] + fixed_order_sum(row)
            m[r] = new_m
        _tile_values(s, v_cache, table, kv_head, k0, k0 + nk, alpha, acc, head_dim)  # acc = acc alpha + P V
    for r in range(n_rows):
        inv_l = np.float32(1.0) / l[r]
        for d in range(head_dim):
            out[first_row + t0 + r // group, kv_head * group + r % group, d] = acc[r, d] * inv_l


# Not cached on disk: its variants (one per head shape) would share one index (cpu/variants.py).
# Its callers are, each variant under its own name (``prefill_kernel`` below, cpu/fused_decode.py).
@njit(parallel=True, fastmath=ORDERED["fastmath"], error_model="numpy")
def paged_prefill_kernel(q, k_cache, v_cache, block_tables, query_starts, context_lens,
                         job_seq, job_t0, scale, out, group, head_dim):
    """Every (query tile, kv head) job of a prefill batch. job_seq, job_t0 (J,) name each tile;
    group (= H / Hkv) and Dh compile-time constants."""
    literally(group)
    literally(head_dim)
    n_kv_heads = k_cache.shape[2]
    for job in prange(len(job_seq) * n_kv_heads):
        tile, kv_head = job // n_kv_heads, job % n_kv_heads
        b, t0 = job_seq[tile], job_t0[tile]
        t1 = min(t0 + PREFILL_QUERY_TILE, query_starts[b + 1] - query_starts[b])
        _prefill_job(q, k_cache, v_cache, block_tables[b], query_starts[b], context_lens[b], t0, t1,
                     kv_head, scale, out, group, head_dim)


@functools.cache
def prefill_kernel(group: int, head_dim: int):
    """paged_prefill_kernel for one head shape, as a function of the arrays alone, compiled on
    first use and cached on disk (cpu/variants.py)."""
    def attention_kernel(q, k_cache, v_cache, block_tables, query_starts, context_lens, job_seq, job_t0, scale, out):
        paged_prefill_kernel(q, k_cache, v_cache, block_tables, query_starts, context_lens, job_seq, job_t0, scale,
                             out, group, head_dim)

    return compile_variant(attention_kernel, group=group, head_dim=head_dim)


def prefill_jobs(query_starts: np.ndarray, context_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sequence, first query) of every query tile, ordered so that equal runs of jobs cost alike.

    Numba splits a prange into one contiguous run per thread, and a causal tile's cost grows with
    its position; listing the tiles longest, shortest, second longest, ... gives every run a mix.
    """
    seqs, starts, cost = [], [], []
    for b in range(len(context_lens)):
        for t0 in range(0, int(query_starts[b + 1] - query_starts[b]), PREFILL_QUERY_TILE):
            seqs.append(b)
            starts.append(t0)
            cost.append(int(context_lens[b]) + t0)
    order = np.argsort(cost, kind="stable")[::-1]           # longest first
    zigzag = np.empty_like(order)
    zigzag[0::2], zigzag[1::2] = order[: (len(order) + 1) // 2], order[(len(order) + 1) // 2:][::-1]
    return np.asarray(seqs, dtype=np.int64)[zigzag], np.asarray(starts, dtype=np.int64)[zigzag]


# A sequence that brings at most this many queries (a speculative verify of k + 1 <= 8 rows, a
# decode row) is attended row by row, by the decode kernel, each row over its own causal keys: a
# query tile of the prefill kernel is mostly padding then, and its few jobs leave a core idle.
# Measured (paged_attention_prefill on both kernels, SmolLM2's 9 / 3 heads, 2 threads, 2-core Xeon
# VM, AVX-512, medians of 50): one sequence of 150 cached keys plus 2 / 5 / 8 / 16 / 64 queries, rows
# 2.7 / 2.1 / 1.85 / 1.5 / 0.97x as fast as tiles; after 1000 keys 1.8 / 1.5 / 1.25 / 1.1 / 0.65x;
# 4 such sequences of 1000 keys 1.4 / 1.1 / 0.92x at 2 / 5 / 8 queries.
ROWS_SPAN_MAX = 8


def attends_by_rows(query_lens: np.ndarray) -> bool:
    """Whether a batch whose sequences bring ``query_lens`` (B,) queries runs the row (decode) kernel."""
    return int(query_lens.max()) <= ROWS_SPAN_MAX


def key_chunks(n_queries: int, n_kv_heads: int, query_keys: np.ndarray) -> int:
    """Chunks each query's keys are split into: more than one only when the (query row, kv head)
    jobs are too few to fill the cores."""
    few_jobs = n_queries * n_kv_heads < 4 * numba.get_num_threads()
    return max(1, int(query_keys.max()) // SPLIT_MIN_KEYS) if few_jobs else 1


def _run_kernel(q, k_cache, v_cache, block_tables, query_seq, query_keys, scale):
    """Choose the chunking, then run the kernel. query_seq, query_keys (N,)."""
    scale = 1 / math.sqrt(q.shape[2]) if scale is None else scale
    n_chunks = key_chunks(len(q), k_cache.shape[2], query_keys)
    n_heads, head_dim = q.shape[1], q.shape[2]
    out = np.empty_like(q)  # (N, H, Dh)
    decode_kernel(n_heads // k_cache.shape[2], head_dim)(
        np.ascontiguousarray(q), np.ascontiguousarray(k_cache), np.ascontiguousarray(v_cache),
        np.ascontiguousarray(block_tables, dtype=np.int32), query_seq.astype(np.int64), query_keys.astype(np.int64),
        n_chunks, np.float32(scale), out)
    return out


def paged_attention_decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                           context_lens: np.ndarray, scale: float | None = None) -> np.ndarray:
    """Numba version of reference.paged_attention_decode: q (B, H, Dh) -> (B, H, Dh)."""
    return _run_kernel(q, k_cache, v_cache, *shapes.paged_decode_rows(q, k_cache, v_cache, block_tables, context_lens), scale)


def paged_attention_prefill(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                            query_starts: np.ndarray, context_lens: np.ndarray,
                            scale: float | None = None) -> np.ndarray:
    """Numba version of reference.paged_attention_prefill: q (N, H, Dh) -> (N, H, Dh); short
    query spans row by row (``attends_by_rows``), longer ones in tiles."""
    block_tables, query_seq, query_keys = shapes.paged_prefill_rows(q, k_cache, v_cache, block_tables, query_starts,
                                                                    context_lens)
    query_starts = np.asarray(query_starts, dtype=np.int64)  # (B+1,)
    if attends_by_rows(np.diff(query_starts)):
        return _run_kernel(q, k_cache, v_cache, block_tables, query_seq, query_keys, scale)
    context_lens = np.asarray(context_lens, dtype=np.int64)  # (B,)
    scale = 1 / math.sqrt(q.shape[2]) if scale is None else scale
    out = np.empty_like(q)  # (N, H, Dh)
    prefill_kernel(q.shape[1] // k_cache.shape[2], q.shape[2])(
        np.ascontiguousarray(q), k_cache, v_cache, np.ascontiguousarray(block_tables, dtype=np.int32),
        query_starts, context_lens, *prefill_jobs(query_starts, context_lens), np.float32(scale), out)
    return out
