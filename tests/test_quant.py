"""Block quantization against the oracle: the `gguf` package (llama.cpp's own Python reference).

- quantize: byte for byte equal to gguf.quants.quantize (which matches ggml-quants.c).
- dequantize (NumPy and Numba): bit for bit equal to gguf.quants.dequantize, on random bytes (every
  fp16 scale pattern included) and on the real model's tensors.
- qmatvec / qmatmul / qlinear: equal to x @ W.T in float64 with W dequantized by gguf, within a
  bound on fp32 accumulation error: |y - y_ref| <= 1e-5 * (|x| @ |W|.T) + 1e-6.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from minillm.kernels import reference
from minillm.kernels.cpu import quant
from minillm.kernels.cpu.quant import BLOCK_BYTES, QMatrix

# Random bytes hold nan and inf scales on purpose; NumPy warns when it multiplies them.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")

QTYPES = ("Q8_0", "Q4_0", "Q4_1")
SMOLLM2_SHAPES = [(1536, 576), (576, 1536), (576, 576), (192, 576)]  # ffn up/gate, ffn down, q/o, k/v


def random_qmatrix(qtype: str, rows: int, cols: int, seed: int = 0) -> QMatrix:
    """Random packed bytes - any scale, any code - as a file could hold them."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, cols // 32 * BLOCK_BYTES[qtype]), dtype=np.uint8)
    return QMatrix(qtype, (rows, cols), data)


def realistic_qmatrix(qtype: str, rows: int, cols: int, seed: int = 0) -> QMatrix:
    """Quantized from weights with a realistic spread (finite scales), for the matvec tests."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 0.2, (rows, 1)).astype(np.float32)
    return QMatrix(qtype, (rows, cols), gguf_quants.quantize(w, GGMLQuantizationType[qtype]))


def oracle_dequantize(qm: QMatrix) -> np.ndarray:
    return gguf_quants.dequantize(qm.data, GGMLQuantizationType[qm.qtype])  # (rows, cols)


def assert_close_to_matmul(y: np.ndarray, x: np.ndarray, qm: QMatrix) -> None:
    """y (T, rows) vs x @ W.T in float64; the tolerance bounds fp32 accumulation error."""
    w = oracle_dequantize(qm).astype(np.float64)  # (rows, cols)
    x = np.atleast_2d(x).astype(np.float64)  # (T, cols)
    expected, scale = x @ w.T, np.abs(x) @ np.abs(w).T  # (T, rows) each
    assert y.dtype == np.float32 and y.shape == expected.shape
    assert np.all(np.abs(y - expected) <= 1e-5 * scale + 1e-6), np.max(np.abs(y - expected) / (scale + 1e-30))


# -----------------------------------------------------------------------------------------------
# Block layouts, quantize, dequantize

def test_block_sizes_are_the_ggml_ones():
    for qtype in QTYPES:
        block_size, type_size = gguf_quants.GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
        assert (block_size, type_size) == (32, BLOCK_BYTES[qtype])


@pytest.mark.parametrize("qtype", QTYPES)
def test_quantize_matches_gguf_byte_for_byte(qtype):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((40, 256)).astype(np.float32) * rng.uniform(1e-4, 10, (40, 1)).astype(np.float32)
    w[0] = 0.0  # an all-zero block: d = 0, no division by zero
    w[1] = 0.25  # constant rows: max == min
    w[2, :32] = np.linspace(-1, 1, 32)  # exact halves land on rounding ties
    w[3, :32] = -3.0
    w[3, 5] = 2.0  # largest magnitude negative: the Q4_0 scale's sign flips
    w[4] = np.round(w[4] * 8) / 8
    qm = quant.quantize(w, qtype)
    assert qm.shape == (40, 256) and qm.qtype == qtype
    np.testing.assert_array_equal(qm.data, gguf_quants.quantize(w, GGMLQuantizationType[qtype]))


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_matches_gguf_bit_for_bit_on_random_bytes(qtype):
    qm = random_qmatrix(qtype, rows=64, cols=320)  # random scales: subnormal, negative, inf, nan
    expected = oracle_dequantize(qm)
    np.testing.assert_array_equal(quant.dequantize_reference(qm), expected)  # NaN == NaN here
    np.testing.assert_array_equal(quant.dequantize(qm), expected)
    np.testing.assert_array_equal(qm.dequantize(), expected)


def test_every_fp16_scale_decodes_exactly():
    """A Q8_0 block with all codes 1 dequantizes to its scale: try all 65,536 fp16 patterns."""
    scales = np.arange(65536, dtype=np.uint32).astype(np.uint16)  # (65536,)
    blocks = np.ones((65536, 34), dtype=np.uint8)
    blocks[:, 0:2] = scales.view(np.uint8).reshape(-1, 2)
    qm = QMatrix("Q8_0", (65536, 32), blocks)
    expected = np.repeat(scales.view(np.float16).astype(np.float32)[:, None], 32, axis=1)  # (65536, 32)
    got = quant.dequantize(qm)
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(got.view(np.uint32)[finite], expected.view(np.uint32)[finite])  # -0.0 too
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_array_equal(got[np.isinf(expected)], expected[np.isinf(expected)])


def test_a_q4_1_block_decoded_by_hand():
    """d = 0.5, m = -1.0, byte j = (j + 1) << 4 | j: weight j = j * 0.5 - 1, weight j + 16 = (j + 1) * 0.5 - 1."""
    block = np.zeros(20, dtype=np.uint8)
    block[0:2] = np.array([0.5], dtype=np.float16).view(np.uint8)
    block[2:4] = np.array([-1.0], dtype=np.float16).view(np.uint8)
    block[4:] = [(j + 1) % 16 << 4 | j for j in range(16)]
    qm = QMatrix("Q4_1", (1, 32), block[None, :])
    low = [j * 0.5 - 1 for j in range(16)]
    high = [((j + 1) % 16) * 0.5 - 1 for j in range(16)]
    np.testing.assert_array_equal(quant.dequantize_reference(qm)[0], np.array(low + high, dtype=np.float32))
    np.testing.assert_array_equal(quant.dequantize(qm)[0], np.array(low + high, dtype=np.float32))


@pytest.mark.parametrize("qtype", QTYPES)
def test_quantize_then_dequantize_is_within_half_a_step(qtype):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((8, 128)).astype(np.float32)
    err = np.abs(quant.dequantize(quant.quantize(w, qtype)) - w).reshape(-1, 32)  # (blocks, 32)
    blocks = w.reshape(-1, 32)
    amax = np.abs(blocks).max(1, keepdims=True)  # (blocks, 1)
    bound = {"Q8_0": 0.5 * amax / 127,  # half a step
             "Q4_0": amax / 8,  # codes reach -8 d but only +7 d: the far end can lose a whole step
             "Q4_1": 0.5 * (blocks.max(1, keepdims=True) - blocks.min(1, keepdims=True)) / 15}[qtype]
    assert np.all(err <= bound * 1.01 + amax * 2e-3)  # + the fp16 rounding of the scale and minimum


def test_qmatrix_and_quantize_refuse_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize(np.zeros((2, 33), dtype=np.float32), "Q8_0")
    with pytest.raises(ValueError, match="unknown block format 'Q5_0'"):
        quant.quantize(np.zeros((2, 32), dtype=np.float32), "Q5_0")
    with pytest.raises(ValueError, match=r"must be uint8 \(2, 20\)"):
        QMatrix("Q4_1", (2, 32), np.zeros((2, 18), dtype=np.uint8))


# -----------------------------------------------------------------------------------------------
# qmatvec (an exercise), qmatmul, qlinear, qembedding

@pytest.mark.ch04_q4_1_dequantize
@pytest.mark.parametrize("rows, cols", [(1, 32), (3, 96), *SMOLLM2_SHAPES[:2]])
def test_exercise_dequantize_q4_1(impl, rows, cols):
    q = impl("ch04_quantization")
    qm = random_qmatrix("Q4_1", rows, cols, seed=rows)
    got = q.dequantize_q4_1(qm.data, rows, cols)
    assert got.dtype == np.float32 and got.shape == (rows, cols)
    np.testing.assert_array_equal(got, oracle_dequantize(qm))


@pytest.mark.ch04_q4_1_dequantize
def test_exercise_dequantize_q4_1_nibble_order(impl):
    q = impl("ch04_quantization")
    block = np.zeros((1, 20), dtype=np.uint8)
    block[0, 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)  # d = 1, m = 0: weights = codes
    block[0, 4] = 0x52  # byte 0: weight 0 = 2 (low nibble), weight 16 = 5 (high nibble)
    got = q.dequantize_q4_1(block, 1, 32)[0]
    assert got[0] == 2.0 and got[16] == 5.0 and got[1] == 0.0


@pytest.mark.ch04_quant_matvec
@pytest.mark.parametrize("rows, cols", [*SMOLLM2_SHAPES, (1, 32), (5, 64)])
def test_exercise_qmatvec_q4_1(impl, rows, cols):
    q = impl("ch04_quantization")
    qm = realistic_qmatrix("Q4_1", rows, cols, seed=cols)
    x = np.random.default_rng(rows).standard_normal(cols).astype(np.float32)
    y = q.qmatvec(x, qm)
    assert_close_to_matmul(y[None, :], x, qm)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("rows, cols", [(1536, 576), (3, 32), (7, 96)])
def test_qmatvec_other_formats(qtype, rows, cols):
    qm = realistic_qmatrix(qtype, rows, cols, seed=rows)
    x = np.random.default_rng(cols).standard_normal(cols).astype(np.float32)
    assert_close_to_matmul(quant.qmatvec(x, qm)[None, :], x, qm)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("T, rows", [(2, 576), (5, 576), (32, 576), (3, 100), (7, 5)])
def test_qmatmul_batches(qtype, T, rows):
    """Whole tiles, a partial last tile (100 rows), fewer rows than one tile (5); T off the 4x4 register tile."""
    qm = realistic_qmatrix(qtype, rows, 1536, seed=T)
    x = np.random.default_rng(T).standard_normal((T, 1536)).astype(np.float32)
    assert_close_to_matmul(quant.qmatmul(x, qm), x, qm)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("T", [1, quant.MATVEC_ROWS_MAX_T, quant.MATVEC_ROWS_MAX_T + 1, 70])
def test_qlinear_every_path(qtype, T):
    """Matvec per row on both sides of the threshold, then qmatmul (600 rows: a partial tile)."""
    qm = realistic_qmatrix(qtype, 600, 64, seed=T)
    x = np.random.default_rng(T).standard_normal((T, 64)).astype(np.float32)
    y = quant.qlinear(x, qm)
    assert_close_to_matmul(y, x, qm)
    np.testing.assert_allclose(reference.qlinear(x, qm), y, rtol=1e-4, atol=1e-4)


def test_qlinear_refuses_a_wrong_width():
    qm = realistic_qmatrix("Q4_1", 4, 64)
    with pytest.raises(ValueError, match=r"cols = 64"):
        quant.qlinear(np.zeros((2, 32), dtype=np.float32), qm)
    with pytest.raises(ValueError, match=r"\(cols,\)"):
        quant.qmatvec(np.zeros((1, 64), dtype=np.float32), qm)


@pytest.mark.parametrize("qtype", QTYPES)
def test_qembedding_decodes_the_named_rows(qtype):
    qm = random_qmatrix(qtype, 100, 64, seed=3)
    ids = np.array([5, 0, 99, 5])
    np.testing.assert_array_equal(quant.qembedding(ids, qm), oracle_dequantize(qm)[ids])
    with pytest.raises(IndexError, match="token id 100 is out of range"):
        quant.qembedding(np.array([1, 100]), qm)


# -----------------------------------------------------------------------------------------------
# The real model's tensors (zero-copy, read-only views of the file)

@pytest.mark.slow
def test_real_tensors_dequantize_bit_for_bit(smollm2_path):
    """The packed bytes are the file's (test_gguf checks them against GGUFReader); gguf decodes them."""
    from minillm.model.gguf import GGUFFile

    gguf = GGUFFile(smollm2_path)
    for name in ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.29.ffn_up.weight"]:
        qm = gguf.tensor(name)
        if name == "token_embd.weight":  # 113 MB as float32: its first 4096 rows are enough
            qm = QMatrix(qm.qtype, (4096, qm.shape[1]), qm.data[:4096])
        expected = oracle_dequantize(qm)
        np.testing.assert_array_equal(quant.dequantize(qm), expected, err_msg=name)
        np.testing.assert_array_equal(quant.dequantize_reference(qm), expected, err_msg=name)


@pytest.mark.slow
def test_real_tensors_matvec_and_embedding(smollm2_path):
    from minillm.model.gguf import GGUFFile

    gguf = GGUFFile(smollm2_path)
    rng = np.random.default_rng(0)
    for name in ["blk.3.ffn_gate.weight", "blk.3.ffn_down.weight", "blk.3.attn_k.weight"]:
        qm = gguf.tensor(name)
        assert not qm.data.flags.writeable  # a view of the mapped file, not a copy
        x = rng.standard_normal((3, qm.shape[1])).astype(np.float32)
        assert_close_to_matmul(quant.qmatvec(x[0], qm)[None, :], x[0], qm)
        assert_close_to_matmul(quant.qlinear(x, qm), x, qm)
    embd = gguf.tensor("token_embd.weight")
    ids = np.array([1, 2, 49151, 9690])
    rows = gguf_quants.dequantize(embd.data[ids], GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(quant.qembedding(ids, embd), rows)
