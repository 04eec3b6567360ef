"""Integer mode (cpu/quant_int8.py) against a NumPy model of its arithmetic, and against exact fp32.

- quantize_activations: equal, bit for bit, to the NumPy model below (the same float32 operations);
- the integer part: each block's sum of q_w q_x is an exact integer, so the kernel's result must
  equal sum_b (d_w d_x isum_b + m_w s_x) computed in float64 from the model, within fp32
  accumulation error alone (1e-5 relative to the sum of magnitudes);
- against exact mode: int8 activations move each x by at most d_x / 2, so |y_int8 - W x| is bounded
  by sum_j |w_j| d_x(j) / 2 (plus the same fp32 slack) - a bound that a wrong scale breaks;
- every instruction set this target can run (generic vectors, AVX2, AVX-512, AVX-512 VNNI), on
  every shape class: 1 row, rows off the interleave, 1 block, the SmolLM2 shapes, T = 1 ... 64;
- T rows in one call (matvec_rows, what qlinear runs for T <= 8; matmul_rows, tiles of 8 rows, for
  more): row t bit for bit the one-row kernel's result for x[t], and within the activation rounding
  of reference.qlinear (the spec);
- through the model: decode batches, prefills and a verify-shaped forward in int8 mode pick the
  tokens the one-row path picks (the same logits, as the kernel rows are bit-identical).
AVX2 code on an AVX-512 host: NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES="" python -m pytest this file.
"""
import numpy as np
import pytest
from test_quant import QTYPES, SMOLLM2_SHAPES, oracle_dequantize, realistic_qmatrix

from minillm.hardware.machine import compile_target
from minillm.kernels import reference
from minillm.kernels.cpu import quant
from minillm.kernels.cpu import quant_int8
from minillm.kernels.cpu.quant_repack import repack

SHAPES = [(1, 32), (1, 576), (3, 64), (7, 96), (13, 32), (17, 576), *SMOLLM2_SHAPES]
T_VALUES = (1, 2, 3, 4, 5, 17, 64)
ROWS_T = range(1, quant.REPACKED_MATVEC_ROWS_MAX_T + 1)  # what qlinear sends to matvec_rows


def runnable_isas() -> list[int]:
    """The kernels this process's target can compile: AVX-512 code needs an AVX-512 target."""
    target = compile_target()
    isas = [quant_int8.GENERIC]
    if target.isa in ("avx2", "avx512"):
        isas.append(quant_int8.AVX2)
    if target.isa == "avx512":
        isas.append(quant_int8.AVX512)
        if target.vnni:
            isas.append(quant_int8.AVX512_VNNI)
    return isas


def rows_per_group_for(isa: int) -> int:
    """The R each kernel takes: the rows of one vector of int32 lanes (16 on AVX-512, 8 on AVX2)."""
    return quant_int8.chunk_lanes(isa)


def activation_rounding_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (T, cols), w (rows, cols) float64 -> (T, rows): how far int8 activations may move x @ w.T.
    Rounding moves each x by at most d_x / 2; fp32 accumulation adds 1e-5 of the magnitudes."""
    T = x.shape[0]
    d_x = np.abs(x).reshape(T, -1, 32).max(axis=2) / 127  # (T, blocks)
    half_step = np.repeat(d_x / 2, 32, axis=1)  # (T, cols)
    return half_step @ np.abs(w).T + 1e-5 * (np.abs(x) @ np.abs(w).T) + 1e-6


def model_quantize_activations(x: np.ndarray):
    """NumPy model of Q8_1 activation quantization, float32 throughout: codes, scales, block sums."""
    blocks = x.astype(np.float32).reshape(-1, 32)  # (blocks, 32)
    d = np.abs(blocks).max(axis=1) / np.float32(127)  # (blocks,)
    with np.errstate(divide="ignore"):
        inverse = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    v = blocks * inverse[:, None]  # (blocks, 32)
    q = (np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))).astype(np.int32)  # roundf: halves away from 0
    return q.astype(np.int8).reshape(-1), d, (d * q.sum(axis=1).astype(np.float32)).astype(np.float32)


def model_int8_matvec(x: np.ndarray, qm) -> tuple[np.ndarray, np.ndarray]:
    """(y, magnitude) in float64: y = sum_b d_w d_x isum + m_w s_x with exact integer block sums."""
    codes, d_x, s_x = model_quantize_activations(x)
    rows, cols = qm.shape
    w = oracle_dequantize(qm).astype(np.float64).reshape(rows, cols // 32, 32)  # (rows, blocks, 32)
    x_hat = codes.astype(np.float64).reshape(-1, 32) * d_x[:, None].astype(np.float64)  # (blocks, 32)
    y = np.einsum("rbj,bj->r", w, x_hat)  # W x_hat: exact int block sums scaled, in float64
    magnitude = np.einsum("rbj,bj->r", np.abs(w), np.abs(x_hat))  # (rows,)
    return y, magnitude


@pytest.mark.parametrize("cols", [32, 96, 1536])
def test_activation_quantization_equals_the_numpy_model(cols):
    rng = np.random.default_rng(cols)
    x = rng.standard_normal((3, cols)).astype(np.float32) * rng.uniform(0.01, 10, (3, 1)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: d = 0, codes 0
    if cols > 32:
        x[1, 32:64] = np.linspace(-127, 127, 32, dtype=np.float32) / 2  # halves: rounding ties
    codes, scales, sums = quant_int8.quantize_activations(x)  # (3, cols), (3, blocks), (3, blocks)
    for t in range(3):
        want_codes, want_scales, want_sums = model_quantize_activations(x[t])
        np.testing.assert_array_equal(codes[t], want_codes)
        np.testing.assert_array_equal(scales[t], want_scales)
        np.testing.assert_array_equal(sums[t], want_sums)
    assert np.abs(codes).max() <= 127


@pytest.mark.parametrize("isa", runnable_isas(), ids=lambda i: quant_int8.ISA_NAMES[i])
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows, cols", SHAPES)
def test_int8_matvec_equals_the_integer_model(isa, qtype, rows, cols):
    qm = realistic_qmatrix(qtype, rows, cols, seed=rows + cols)
    x = np.random.default_rng(cols).standard_normal(cols).astype(np.float32)
    y = quant_int8.matvec(x, repack(qm, "int8", rows_per_group_for(isa)), isa=isa)
    expected, magnitude = model_int8_matvec(x, qm)
    assert y.dtype == np.float32 and y.shape == (rows,)
    assert np.all(np.abs(y - expected) <= 1e-5 * magnitude + 1e-6)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("T", T_VALUES)
def test_int8_qlinear_is_within_the_activation_rounding_of_exact(qtype, T):
    qm = realistic_qmatrix(qtype, 101, 96, seed=T)  # 101 rows: not a multiple of 4 or 8
    x = np.random.default_rng(T).standard_normal((T, 96)).astype(np.float32)
    y = quant.qlinear(x, repack(qm, "int8"))  # (T, 101)
    w = oracle_dequantize(qm).astype(np.float64)  # (101, 96)
    exact = x.astype(np.float64) @ w.T  # (T, 101)
    assert np.all(np.abs(y - exact) <= activation_rounding_bound(x.astype(np.float64), w))


@pytest.mark.parametrize("isa", runnable_isas(), ids=lambda i: quant_int8.ISA_NAMES[i])
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows, cols", SHAPES)
def test_int8_rows_are_the_one_row_kernel_and_within_rounding_of_the_reference(isa, qtype, rows, cols):
    """T = 1..8 rows in one call: each row bit for bit the one-row kernel's (whose arithmetic the
    integer-model test pins down), and all of them within the activation rounding of reference.qlinear."""
    qm = realistic_qmatrix(qtype, rows, cols, seed=3 * rows + cols)
    w = repack(qm, "int8", rows_per_group_for(isa))
    x = np.random.default_rng(rows * cols).standard_normal((max(ROWS_T), cols)).astype(np.float32)
    x[-1] *= 40  # rows of very different scales share the call
    one_row = np.stack([quant_int8.matvec(row, w, isa=isa) for row in x])  # (8, rows)
    spec = reference.qlinear(x, qm).astype(np.float64)                      # (8, rows)
    bound = activation_rounding_bound(x.astype(np.float64), oracle_dequantize(qm).astype(np.float64))
    for T in ROWS_T:
        y = quant_int8.matvec_rows(x[:T], w, isa=isa)  # (T, rows)
        assert y.dtype == np.float32 and y.shape == (T, rows)
        np.testing.assert_array_equal(y, one_row[:T], err_msg=f"T = {T}")
        assert np.all(np.abs(y - spec[:T]) <= bound[:T]), f"T = {T}"


@pytest.mark.parametrize("isa", runnable_isas(), ids=lambda i: quant_int8.ISA_NAMES[i])
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows, cols", SHAPES)
def test_int8_matmul_rows_are_the_one_row_kernel(isa, qtype, rows, cols):
    """T > 8 rows (a prefill, a decode batch past 8 streams, the verify of several sequences): tiles
    of 8 rows, then the rest in pieces of 4, 2 and 1, each row bit for bit the one-row kernel's."""
    qm = realistic_qmatrix(qtype, rows, cols, seed=rows + 5 * cols)
    w = repack(qm, "int8", rows_per_group_for(isa))
    x = np.random.default_rng(rows + cols).standard_normal((23, cols)).astype(np.float32)
    x[3] *= 40     # rows of very different scales share a tile
    x[19] *= 1e-3  # and a piece
    one_row = np.stack([quant_int8.matvec(row, w, isa=isa) for row in x])  # (23, rows)
    for T in (16, 23):  # whole tiles; two tiles and pieces of 4, 2 and 1
        y = quant_int8.matmul_rows(x[:T], w, isa=isa)
        assert y.dtype == np.float32 and y.shape == (T, rows)
        np.testing.assert_array_equal(y, one_row[:T], err_msg=f"T = {T}")


def test_qlinear_sends_int8_rows_to_one_kernel_call(monkeypatch):
    """The dispatch: T <= 8 rows on an int8 matrix are one matvec_rows call, not T matvec calls; more
    rows one matmul_rows call (integer dot products at any T, not the fp32 qmatmul)."""
    qm = repack(realistic_qmatrix("Q4_1", 64, 96), "int8")
    calls = []
    monkeypatch.setattr(quant_int8, "matvec", lambda *a, **k: calls.append("matvec"))
    monkeypatch.setattr(quant, "qmatmul", lambda *a, **k: calls.append("qmatmul"))
    for kernel in ("matvec_rows", "matmul_rows"):
        real = getattr(quant_int8, kernel)
        monkeypatch.setattr(quant_int8, kernel, lambda x, w, kernel=kernel, real=real: calls.append((kernel, x.shape[0]))
                            or real(x, w))
    quant.qlinear(np.ones((5, 96), dtype=np.float32), qm)
    quant.qlinear(np.ones((30, 96), dtype=np.float32), qm)
    assert calls == [("matvec_rows", 5), ("matmul_rows", 30)]


def test_the_hot_loop_uses_the_integer_instructions():
    """What chapter 04 shows: vpdpbusd on VNNI targets, vpmaddubsw + vpmaddwd on AVX2 / AVX-512."""
    loop = quant.inner_loop_asm("int8", "Q4_1")
    target = compile_target()
    if target.isa == "avx512" and target.vnni:
        assert any(line.startswith("vpdpbusd") for line in loop)
    elif target.isa in ("avx2", "avx512"):
        assert any(line.startswith("vpmaddubsw") for line in loop)
        assert any(line.startswith("vpmaddwd") for line in loop)
    assert any(line.startswith("vfmadd") for line in loop)  # two FMAs per block and vector of rows


# -----------------------------------------------------------------------------------------------
# Through the model: the T-row kernel changes no token

def _greedy_batch_and_verify(model, prompts, steps: int, verify_len: int):
    """Prefill each prompt in its own slot, decode all of them together (one row each) ``steps``
    times greedily, then run a verify-shaped forward (``verify_len`` rows of sequence 0, logits for
    every row) -> (the tokens (steps, B), the decode logits (steps, B, V), the verify logits)."""
    from minillm.model.kv_cache import AttentionMetadata, ContiguousKVCache

    B = len(prompts)
    cache = ContiguousKVCache(model.config, n_slots=B, max_len=64)
    last = []
    for slot, ids in enumerate(prompts):
        meta = AttentionMetadata(query_lens=[len(ids)], context_lens=[0], seq_slots=[slot])
        last.append(int(np.argmax(model.forward(np.asarray(ids), meta, cache)[0])))
    lengths = [len(ids) for ids in prompts]
    tokens, logits = [], []
    for _ in range(steps):
        meta = AttentionMetadata(query_lens=[1] * B, context_lens=lengths, seq_slots=list(range(B)))
        out = model.forward(np.asarray(last), meta, cache)  # (B, V): B rows through every matvec
        logits.append(out)
        last = [int(i) for i in np.argmax(out, axis=1)]
        tokens.append(last)
        lengths = [n + 1 for n in lengths]
    draft = [*tokens[-1][:1], *max(prompts, key=len)[:verify_len - 1]]  # k + 1 rows of one sequence, as a verify sends
    meta = AttentionMetadata(query_lens=[verify_len], context_lens=[lengths[0]], seq_slots=[0],
                             logits_indices=np.arange(verify_len))
    return np.array(tokens), np.stack(logits), model.forward(np.asarray(draft), meta, cache)


@pytest.mark.slow
def test_int8_model_rows_in_one_call_give_the_one_row_tokens(smollm2_path, monkeypatch):
    """Decode batches of 8 streams, prefills of up to 13 tokens and a 12-row verify in int8 mode
    (T-row calls of up to 8 rows, tiles of 8 beyond): the same logits, bit for bit, and so the same
    greedy tokens, as when every row runs the one-row kernel alone."""
    from minillm.model.loader import load_model

    model = load_model(smollm2_path, activations="int8")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (3, 5, 7, 9, 11, 4, 6, 13)]
    tokens, logits, verify = _greedy_batch_and_verify(model, prompts, steps=4, verify_len=12)

    rows_in_one_call = quant_int8.matvec_rows

    def one_row_at_a_time(x, w, isa=None):
        return np.concatenate([rows_in_one_call(x[t:t + 1], w, isa) for t in range(len(x))])  # (T, rows)

    monkeypatch.setattr(quant_int8, "matvec_rows", one_row_at_a_time)
    monkeypatch.setattr(quant_int8, "matmul_rows", one_row_at_a_time)
    want_tokens, want_logits, want_verify = _greedy_batch_and_verify(model, prompts, steps=4, verify_len=12)
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_array_equal(logits, want_logits)
    np.testing.assert_array_equal(verify, want_verify)
