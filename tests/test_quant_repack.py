"""Repacked weights (cpu/quant_repack.py) and the exact-mode SIMD matvec (cpu/quant_fp32.py) against the oracle.

- the layout: every code, scale and minimum lands where the module docstring says (rows as exact
  mode reads them, and int8 mode's 4-byte chunks, Q8_0's as q + 128), compared with the `gguf`
  package's dequantization (w = d q + m for every weight);
- the kernel: equal to x @ W.T in float64 (W dequantized by gguf) within the fp32 accumulation bound
  of test_quant.py, on every shape class: 1 row, rows that are not a multiple of the interleave R,
  1 block, the SmolLM2 shapes; R = 4 (AVX2's) and 8 (AVX-512's), whichever the host compiles for;
- T rows at once (quant_fp32.matvec_rows): the oracle, and bit for bit each row alone;
- the dispatch: quant.qlinear on a RepackedMatrix for T = 1 ... 64, and the reference backend's
  qlinear on the same object (it reads the GGUF bytes the RepackedMatrix still carries).
"""
import numpy as np
import pytest
from test_quant import QTYPES, SMOLLM2_SHAPES, assert_close_to_matmul, oracle_dequantize, realistic_qmatrix

from minillm.hardware.machine import compile_target
from minillm.kernels import reference
from minillm.kernels.cpu import quant
from minillm.kernels.cpu import quant_fp32
from minillm.kernels.cpu.quant import QMatrix
from minillm.kernels.cpu.quant_repack import CODE_BYTES, HALF_SCALES, ROWS_PER_GROUP, RepackedMatrix, repack

SHAPES = [(1, 32), (1, 576), (3, 64), (7, 96), (13, 32), (17, 576), *SMOLLM2_SHAPES]
T_VALUES = (1, 2, 3, 4, 5, 17, 64)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("activations, rows_per_group", [("fp32", 4), ("fp32", 8), ("int8", 8), ("int8", 16)])
def test_repack_puts_every_code_scale_and_minimum_in_place(qtype, activations, rows_per_group):
    rows, cols = 13, 96  # a partial last group
    qm = realistic_qmatrix(qtype, rows, cols, seed=rows_per_group)
    w = repack(qm, activations, rows_per_group)
    groups, n_blocks, R = w.groups, cols // 32, rows_per_group
    assert isinstance(w, QMatrix) and w.shape == qm.shape and w.data is qm.data
    assert w.chunked == (activations == "int8")
    if w.chunked:  # (groups, blocks, chunk k, R, byte i) holds code byte 4k + i of each row's block
        n_chunks = CODE_BYTES[qtype] // 4
        codes = w.quants.reshape(groups, n_blocks, n_chunks, R, 4).transpose(0, 1, 3, 2, 4).reshape(
            groups, n_blocks, R, CODE_BYTES[qtype])
        if qtype == "Q8_0":  # stored as q + 128 (unsigned bytes for vpdpbusd)
            codes = codes ^ np.uint8(0x80)
    else:
        codes = w.quants.reshape(groups, n_blocks, R, CODE_BYTES[qtype])
    half = w.chunked and HALF_SCALES  # scales and minimums as fp16 bits
    assert w.scales.dtype == (np.uint16 if half else np.float32)
    as_float = (lambda a: a.view(np.float16).astype(np.float32)) if half else (lambda a: a)
    d = as_float(w.scales).reshape(groups, n_blocks, R)
    if qtype == "Q8_0":
        q = codes.view(np.int8).astype(np.float32)  # (groups, blocks, R, 32)
        m = np.zeros_like(d)
    else:
        q = np.concatenate([codes & 15, codes >> 4], axis=-1).astype(np.float32)  # (groups, blocks, R, 32)
        m = as_float(w.mins).reshape(groups, n_blocks, R)
    weights = q * d[..., None] + m[..., None]  # (groups, blocks, R, 32)
    weights = weights.transpose(0, 2, 1, 3).reshape(groups * R, cols)  # (padded rows, cols)
    np.testing.assert_array_equal(weights[:rows], oracle_dequantize(qm))
    assert not weights[rows:].any()  # the padding rows are zero


def test_repack_refuses_an_unknown_activation_mode():
    with pytest.raises(ValueError, match=r"activations must be one of 'fp32', 'int8', got 'int4'"):
        repack(realistic_qmatrix("Q4_1", 4, 64), "int4")


def test_the_batched_matmul_refuses_groups_that_do_not_tile():
    """qmatmul decodes tiles of quant.TILE_ROWS rows, whole groups each: an R that does not divide
    it would read a group from the middle of another (found as wrong prefill logits at R = 32)."""
    w = repack(realistic_qmatrix("Q4_1", 64, 64), "fp32", 32)
    with pytest.raises(ValueError, match=r"tiles of 48 rows: a repacked matrix's rows_per_group must divide 48, got 32"):
        quant.qmatmul(np.ones((10, 64), dtype=np.float32), w)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows, cols", SHAPES)
@pytest.mark.parametrize("rows_per_group", sorted({4, ROWS_PER_GROUP}))
def test_fp32_matvec_matches_the_oracle(qtype, rows, cols, rows_per_group):
    qm = realistic_qmatrix(qtype, rows, cols, seed=rows + cols)
    x = np.random.default_rng(cols).standard_normal(cols).astype(np.float32)
    y = quant_fp32.matvec(x, repack(qm, rows_per_group=rows_per_group))
    assert_close_to_matmul(y[None, :], x, qm)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("T", T_VALUES)
def test_qlinear_on_repacked_weights_every_batch_size(qtype, T):
    qm = realistic_qmatrix(qtype, 101, 96, seed=T)  # 101 rows: not a multiple of 4 or 8
    w = repack(qm)
    x = np.random.default_rng(T).standard_normal((T, 96)).astype(np.float32)
    y = quant.qlinear(x, w)
    assert_close_to_matmul(y, x, qm)
    np.testing.assert_allclose(reference.qlinear(x, w), y, rtol=1e-4, atol=1e-4)  # the reference backend


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("T", range(1, quant.REPACKED_MATVEC_ROWS_MAX_T + 1))
def test_fp32_matvec_of_t_rows_matches_the_oracle_and_each_row_alone(qtype, T):
    # One kernel call for T rows (a speculative verify, a small decode batch) must be x @ W.T and,
    # bit for bit, what each row gives alone: a token's logits may not depend on its neighbours.
    qm = realistic_qmatrix(qtype, 13, 96, seed=T)  # 13 rows: a partial last group for R = 4 and 8
    w = repack(qm)
    x = np.random.default_rng(T).standard_normal((T, 96)).astype(np.float32)
    y = quant_fp32.matvec_rows(x, w)
    assert_close_to_matmul(y, x, qm)
    np.testing.assert_array_equal(y, np.stack([quant_fp32.matvec(row, w) for row in x]))


def test_qmatvec_checks_the_input_of_a_repacked_matrix():
    w = repack(realistic_qmatrix("Q4_1", 8, 64))
    with pytest.raises(ValueError, match=r"cols = 64"):
        quant.qmatvec(np.zeros(32, dtype=np.float32), w)


def test_the_hot_loop_is_vector_fma():
    """What chapter 04 shows: the fp32 kernel's innermost loop, full-width vector FMAs (two for each of
    the R rows: codes x activations, then d x that into the row's sum), no scalar arithmetic."""
    loop = quant.inner_loop_asm("fp32", "Q4_1")
    register = "zmm" if compile_target().vector_bits == 512 else "ymm"
    wide_fmas = [line for line in loop if line.startswith("vfmadd") and register in line]
    assert len(wide_fmas) >= 2 * ROWS_PER_GROUP * (512 // compile_target().vector_bits)
    assert not any(line.startswith(("vfmadd231ss", "vmulss", "vaddss")) for line in loop)


@pytest.mark.slow
def test_repacked_real_tensors(smollm2_path):
    from minillm.model.gguf import GGUFFile

    gguf = GGUFFile(smollm2_path)
    x = np.random.default_rng(0).standard_normal(1536).astype(np.float32)
    for name in ["blk.3.ffn_gate.weight", "blk.3.ffn_down.weight", "blk.3.attn_k.weight", "token_embd.weight"]:
        qm = gguf.tensor(name)
        if name == "token_embd.weight":  # the LM head: its first 4096 rows are enough
            qm = QMatrix(qm.qtype, (4096, qm.shape[1]), qm.data[:4096])
        w = repack(qm)
        assert isinstance(w, RepackedMatrix)
        xs = x[:qm.shape[1]]
        assert_close_to_matmul(quant.qmatvec(xs, w)[None, :], xs, qm)


def test_load_model_refuses_an_unknown_activation_mode(tmp_path):
    from minillm.model.loader import load_model

    with pytest.raises(ValueError, match=r"activations must be one of 'fp32', 'int8', got 'fp16'"):
        load_model(tmp_path / "model.gguf", activations="fp16")
    with pytest.raises(ValueError, match=r"activations='int8' runs on the numba backend only, not on 'reference'"):
        load_model(tmp_path / "model.gguf", backend="reference", activations="int8")
