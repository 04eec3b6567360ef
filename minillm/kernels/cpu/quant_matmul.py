"""The batched quantized matmul's two halves: decode a tile of weights, multiply it in register blocks.

quant.qmatmul computes out (T, N) = x (T, K) @ W.T for T > 8 rows (decode batches, prefill chunks).
It decodes W a tile of rows at a time into fp32 and multiplies each tile by every row of x, so
the decode is paid once per call and the multiply runs at the FMA units' rate. Both halves are
written here as LLVM vector IR (cpu/quant_llvm.py):

``decode_repacked_rows`` - rows of a RepackedMatrix (cpu/quant_repack.py) to fp32: one 16-byte load
    a row and block, unpacked as the exact matvec unpacks it (quant_fp32.unpack_fp32), then
    w = q d + m as one FMA. q d is exact in fp32 (a 4- or 8-bit code times an fp16 scale), so the
    FMA rounds once, as gguf's dequantize does: the weights are bit for bit the reference's.

``weight_rows_tile`` - the register block. x comes in *panels* of NT rows, transposed:
    x_panel[k] = x[row0:row0 + NT, k], so one vector load takes the NT rows' activations at one k,
    and a panel's K x NT floats lie in one run of memory. The block keeps WR x NT results in
    registers:

        for k in range(k0, k1):
            xs = x_panel[k]                         # (NT,) one load (two on AVX2)
            for j in range(WR):                     # W[j, k] broadcast to every lane
                acc[j] += W[j, k] * xs              # WR FMAs per load
        out_t[j, row0:row0 + NT] = acc[j]           # the result transposed: one vector store a row

    WR x NT / 16 FMAs per k against one vector load and WR broadcasts (folded into the FMAs on
    AVX-512). K is cut into chunks (quant.K_CHUNK) so that a chunk of the panel and of WR weight
    rows stay in L1; a later chunk starts from the sums the earlier one stored. Each output is one
    FMA chain over k = 0..K-1 in order, whatever T is and wherever its row falls: a row's result
    does not depend on the rest of the batch.

Measured (one thread, one 48 x 576 tile in cache, T = 64; 2-core Zen 5 VM, AVX-512, best of 5;
the machine's FMA peak measured the same way, minillm.hardware.microbench.fma_flops: 235 GFLOP/s):
WR x NT = 12 x 32: 205 GFLOP/s; 8 x 32: 193; 24 x 16: 168.

Where the rest goes, and what did not help (2-core Xeon VM, AVX-512, 2026-12-07; one thread's FMA
peak 242 GFLOP/s, two threads' 482). The register block reaches 80-83% of one thread's peak with
its tile in cache; a whole call, 58-66% of two threads' at T = 64-256, because it also decodes the
tiles (10-17% of a call at T = 64, under 3% at T = 256) and writes the (T, rows) result (2-10%),
on the FFN's matrices, one or two threads. Tried, and not kept:
- the tile laid out in blocks of WR rows x 32 k, so that every broadcast sits at a fixed offset from
  one pointer (no address arithmetic left in the loop): the same speed;
- 14 x 32 blocks: 3% faster in cache, but a tile must then hold 112 rows (a multiple of 14 and of
  int8 mode's 16-row groups), which a 576-row matrix shares unevenly between two threads: slower;
- the k loop unrolled 2 or 4 times in the IR: 2x slower (LLVM spilled the accumulators);
- the transposition back to (T, rows) through 16 x 16 blocks in vector registers: no faster than
  the scalar loop, which is bound by the writes of the result (1.5 MB at T = 256), not its loads.
"""
from __future__ import annotations

from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from minillm.hardware.machine import compile_target
from minillm.kernels.cpu import quant_llvm as L
from minillm.kernels.cpu.quant_fp32 import Q8_0_CODE, QTYPE_CODES, nibbles_fp32, unpack_fp32
from minillm.kernels.cpu.quant_repack import RepackedMatrix

# weight rows (WR) and lanes of x rows (NT) in one register block: 12 x 2 zmm of 32 registers on
# AVX-512, 6 x 2 ymm of 16 on AVX2 (NEON's 32 registers of 4 lanes: 6 x 4). A batch of at most
# NT_NARROW rows takes a block one vector wide (24 x 1 zmm, 12 x 1 ymm): padded to NT, half its FMAs
# would multiply zeros.
WR, NT = (12, 32) if compile_target().vector_bits == 512 else (6, 16)
WR_NARROW, NT_NARROW = 2 * WR, NT // 2


@intrinsic
def weight_rows_tile(typingctx, x_panel, tile, out_t, row0, tile_row0, k0, k1, weight_rows, lanes):
    """out_t[tile_row0 + j, row0:row0 + NT] += tile[tile_row0 + j, k] * x_panel[k] for k0 <= k < k1
    and j < WR, starting from zero when k0 == 0: x_panel (K, NT), tile (rows, K) decoded weights,
    out_t (rows, T padded) the result transposed, all 2-D C-contiguous float32; WR and NT
    compile-time constants. Nothing is checked."""
    if not all(isinstance(c, types.IntegerLiteral) for c in (weight_rows, lanes)):
        return None
    n_rows, n_lanes = weight_rows.literal_value, lanes.literal_value

    def codegen(context, builder, sig, args):
        x_ptr, tile_ptr, out_ptr = (L.array_data(context, builder, sig.args[i], args[i]) for i in range(3))
        row0, tile_row0, k0, k1 = args[3], args[4], args[5], args[6]
        T = L.array_shape(context, builder, sig.args[2], args[2], 1)
        K = L.array_shape(context, builder, sig.args[1], args[1], 1)
        vNT = L.vector(L.F32, n_lanes)
        out_rows = [builder.mul(builder.add(tile_row0, L.index(j)), T) for j in range(n_rows)]
        out_at = [builder.bitcast(builder.gep(out_ptr, [builder.add(at, row0)]), vNT.as_pointer()) for at in out_rows]
        first_chunk = builder.icmp_signed("==", k0, L.index(0))
        zeros = L.constant_vector(L.F32, [0.0] * n_lanes)
        acc = [L.accumulator(builder, builder.select(first_chunk, zeros, builder.load(at, align=4)))
               for at in out_at]  # WR x (NT,)
        w_rows = [builder.mul(builder.add(tile_row0, L.index(j)), K) for j in range(n_rows)]
        with cgutils.for_range_slice(builder, k0, k1, L.index(1)) as (k, _):
            xs = L.load(builder, x_ptr, builder.mul(k, L.index(n_lanes)), vNT)  # (NT,) x_panel[k]
            for j in range(n_rows):
                w = L.splat(builder, builder.load(builder.gep(tile_ptr, [builder.add(w_rows[j], k)])), n_lanes)
                builder.store(L.fma(builder, w, xs, builder.load(acc[j])), acc[j])
        for j in range(n_rows):
            builder.store(builder.load(acc[j]), out_at[j], align=4)
        return context.get_dummy_value()

    return types.void(x_panel, tile, out_t, row0, tile_row0, k0, k1, weight_rows, lanes), codegen


# layouts beside quant_fp32's Q8_0_CODE and Q4_CODE: int8 mode's chunked 4-bit and Q8_0 codes
Q4_CHUNKED, Q8_0_CHUNKED = 2, 3


def repacked_layout(w: RepackedMatrix) -> int:
    """Where decode_repacked_rows finds w's codes: rows as exact mode lays them, or chunked."""
    if w.chunked:
        return Q8_0_CHUNKED if w.qtype == "Q8_0" else Q4_CHUNKED
    return QTYPE_CODES[w.qtype]


def _chunked_row_codes(builder, quants, first, R, row, code_bytes: int):
    """Row ``row``'s code bytes (16, or Q8_0's 32) of the block whose group starts at element
    ``first`` (its rows' scales), gathered from the chunks of the chunked layout (cpu/quant_repack.py)."""
    n_chunks = code_bytes // 4
    codes = L.constant_vector(L.I32, [0] * n_chunks)
    for k in range(n_chunks):
        at = builder.add(builder.mul(first, L.index(code_bytes)),
                         builder.mul(builder.add(builder.mul(L.index(k), R), row), L.index(4)))
        codes = builder.insert_element(codes, L.load(builder, quants, at, L.I32), L.index(k))
    return builder.bitcast(codes, L.vector(L.I8, code_bytes))


@intrinsic
def decode_repacked_rows(typingctx, quants, scales, mins, layout, rows_per_group, group0, tile):
    """tile[i] = row group0 * R + i of the repacked W, in fp32, for i < tile rows (a multiple of R):
    quants, scales, mins a RepackedMatrix's arrays, tile (rows, K) C-contiguous float32; the code
    layout (``repacked_layout``) a compile-time constant. Nothing is checked."""
    if not isinstance(layout, types.IntegerLiteral):
        return None
    code = layout.literal_value
    q8 = code in (Q8_0_CODE, Q8_0_CHUNKED)
    code_bytes = 32 if q8 else 16

    def codegen(context, builder, sig, args):
        q_ptr, d_ptr, m_ptr = (L.array_data(context, builder, sig.args[i], args[i]) for i in range(3))
        tile_ptr = L.array_data(context, builder, sig.args[6], args[6])
        R, group0 = args[4], args[5]
        half = sig.args[1].dtype == types.uint16
        n_rows, K = (L.array_shape(context, builder, sig.args[6], args[6], dim) for dim in (0, 1))
        n_blocks = builder.udiv(K, L.index(32))
        with cgutils.for_range(builder, builder.udiv(n_rows, R)) as groups:
            # row by row, block after block: the stores run along one row of the tile. Block by block
            # across a group's rows instead, they went to rows 6 KB apart (K = 1536) and ran 2x slower.
            with cgutils.for_range(builder, R) as rows:
                row = builder.add(builder.mul(groups.index, R), rows.index)
                with cgutils.for_range(builder, n_blocks) as blocks:
                    g, b = builder.add(group0, groups.index), blocks.index
                    first = builder.mul(builder.add(builder.mul(g, n_blocks), b), R)
                    at = builder.add(first, rows.index)
                    if code == Q4_CHUNKED:
                        low, high = nibbles_fp32(builder, _chunked_row_codes(builder, q_ptr, first, R, rows.index, 16))
                    elif code == Q8_0_CHUNKED:  # stored as q + 128: back to q
                        q = builder.xor(_chunked_row_codes(builder, q_ptr, first, R, rows.index, 32),
                                        L.constant_vector(L.I8, [-128] * 32))
                        low, high = (builder.sitofp(L.pick(builder, q, q, range(i, i + 16)), L.vector(L.F32, 16))
                                     for i in (0, 16))
                    else:
                        low, high = unpack_fp32(builder, q_ptr, builder.mul(at, L.index(code_bytes)), code)
                    d = L.splat(builder, L.load_scales(builder, d_ptr, at, 1, half), 16)  # this row's d and m
                    m = (L.constant_vector(L.F32, [0.0] * 16) if q8  # Q8_0: no m
                         else L.splat(builder, L.load_scales(builder, m_ptr, at, 1, half), 16))
                    start = builder.add(builder.mul(row, K), builder.mul(b, L.index(32)))
                    for part, codes in enumerate((low, high)):  # weights 0..15, 16..31 of the block
                        L.store(builder, tile_ptr, builder.add(start, L.index(16 * part)), L.fma(builder, codes, d, m))
        return context.get_dummy_value()

    signature = types.void(quants, scales, mins, layout, rows_per_group, group0, tile)
    return signature, codegen
