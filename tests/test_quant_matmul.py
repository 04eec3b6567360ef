"""The batched quantized matmul (quant.qmatmul, cpu/quant_matmul.py) against the oracle.

- decoding: x = the identity gives W.T itself (each output is one weight times 1 plus zeros), so
  the decoded tiles are compared bit for bit with gguf's dequantize, GGUF bytes and both repacked
  layouts alike;
- the product: x @ W.T in float64 within the fp32 accumulation bound of test_quant, on repacked
  matrices of both activation modes, T off the register block, rows off the tile and the group;
- batch invariance: a row's result is bit for bit the same whatever rows share its call;
- the AVX2 code path (another register block), in a process of its own.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
from test_quant import QTYPES, assert_close_to_matmul, oracle_dequantize, realistic_qmatrix

from minillm.hardware.machine import compile_target
from minillm.kernels.cpu import quant, quant_matmul
from minillm.kernels.cpu.quant_repack import repack


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("layout", ["GGUF", "fp32", "int8"])  # int8: codes in 4-byte chunks
@pytest.mark.parametrize("rows", [7, 100, quant.TILE_ROWS * 3])
def test_the_identity_gives_the_decoded_weights_bit_for_bit(qtype, layout, rows):
    qm = realistic_qmatrix(qtype, rows, 64 * 3, seed=rows)
    w = qm if layout == "GGUF" else repack(qm, layout)
    identity = np.eye(qm.shape[1], dtype=np.float32)  # (cols, cols): T = cols rows
    np.testing.assert_array_equal(quant.qmatmul(identity, w), oracle_dequantize(qm).T)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("activations", ["fp32", "int8"])  # qmatmul is fp32 on either layout
@pytest.mark.parametrize("T, rows", [(quant_matmul.NT_NARROW, 576), (quant_matmul.NT_NARROW + 1, 100), (70, 5),
                                     (2 * quant_matmul.NT, 600)])
def test_repacked_batches_match_the_oracle(qtype, activations, T, rows):
    qm = realistic_qmatrix(qtype, rows, 1536, seed=T)
    x = np.random.default_rng(T).standard_normal((T, 1536)).astype(np.float32)
    assert_close_to_matmul(quant.qmatmul(x, repack(qm, activations)), x, qm)


@pytest.mark.parametrize("T, cols", [(1, 32), (17, 96), (32, 1536), (45, 160)])
@pytest.mark.parametrize("lanes", [quant_matmul.NT_NARROW, quant_matmul.NT])
def test_x_panels_are_the_rows_transposed_lanes_at_a_time(T, cols, lanes):
    """cols past a whole k-block (96 = 64 + 32), T off a whole panel: the padding lanes are zero."""
    x = np.random.default_rng(T).standard_normal((T, cols)).astype(np.float32)
    padded = np.zeros((-(-T // lanes) * lanes, cols), dtype=np.float32)
    padded[:T] = x
    np.testing.assert_array_equal(quant._x_panels(x, lanes), padded.reshape(-1, lanes, cols).transpose(0, 2, 1))


@pytest.mark.parametrize("repacked", [False, True])
def test_a_rows_result_does_not_depend_on_its_batch(repacked):
    qm = realistic_qmatrix("Q4_1", 200, 640, seed=3)
    w = repack(qm) if repacked else qm
    x = np.random.default_rng(3).standard_normal((45, 640)).astype(np.float32)
    whole = quant.qmatmul(x, w)
    for rows in ([0], [44], list(range(10, 19)), [3, 40, 7], list(range(45))[::-1]):
        np.testing.assert_array_equal(quant.qmatmul(x[rows], w), whole[rows])


@pytest.mark.skipif(compile_target().isa == "avx2", reason="this process already runs the AVX2 code path")
def test_the_avx2_code_path():
    """NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES="": this file's tests on AVX2 code (a 6 x 16 block)."""
    env = os.environ | {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": ""}
    code = ("import sys, pytest\n"
            "from minillm.kernels.cpu import quant_matmul\n"
            "assert (quant_matmul.WR, quant_matmul.NT) == (6, 16)\n"
            f"sys.exit(pytest.main([{__file__!r}, '-q', '-p', 'no:cacheprovider', '-k', 'not avx2']))\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1200,
                          cwd=os.path.dirname(__file__))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout, done.stdout[-1000:]
