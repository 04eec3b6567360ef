"""The CUDA kernels against the NumPy reference, on tiny and awkward shapes.

Under the simulator every GPU thread is a Python thread, so shapes stay tiny - but awkward: size 1,
odd sizes, sizes that overhang a block or a tile by one, one kv head and as many kv heads as query
heads. fp32 tolerances: elementwise ops and row statistics 1e-5 relative (a few float32 roundings
apart); dot products of K terms accumulate ~K roundings in a different order than NumPy, so
matmul-like results get 1e-4 absolute on unit-normal inputs of K <= 64.
"""
import os
import subprocess
import sys
import types

import numpy as np
import pytest

import minillm.kernels.cuda as gpu
from minillm.kernels import reference
from minillm.kernels.cpu.quant import dequantize_reference, quantize

pytestmark = pytest.mark.cuda

CH03 = "ch03_gpu_kernels"
RTOL = 1e-5
DOT_ATOL = 1e-4


def normal(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# -----------------------------------------------------------------------------------------------
# Chapter 03 exercises (run against the package, or against exercises/ with --impl=exercises)


@pytest.mark.ch03_vector_add
@pytest.mark.parametrize("n", [1, 33, 300])  # one thread; one warp + 1; one block of 256 + 44
def test_vector_add(impl, rng, n):
    k = impl(CH03)
    a, b = normal(rng, n), normal(rng, n)
    np.testing.assert_array_equal(k.vector_add(a, b), a + b)  # one float32 add: bit-exact


@pytest.mark.ch03_block_reduce
@pytest.mark.parametrize("n", [1, 31, 32, 33, 300])  # 300: two blocks, so a second pass
def test_reduce_sum(impl, rng, n):
    k = impl(CH03)
    x = normal(rng, n)
    got = k.reduce_sum(x)
    assert isinstance(got, float)
    exact = np.sum(x, dtype=np.float64)
    assert abs(got - exact) <= RTOL * np.sum(np.abs(x), dtype=np.float64)


@pytest.mark.ch03_tiled_matmul
@pytest.mark.parametrize("M, K, N", [(1, 1, 1), (5, 7, 3), (17, 33, 18)])  # 16-tiles overhang by 1-2
def test_matmul_tiled(impl, rng, M, K, N):
    k = impl(CH03)
    a, b = normal(rng, M, K), normal(rng, K, N)
    np.testing.assert_allclose(k.matmul_tiled(a, b), reference.matmul(a, b), rtol=RTOL, atol=DOT_ATOL)


@pytest.mark.ch03_rmsnorm
@pytest.mark.parametrize("T, D", [(1, 1), (3, 37), (2, 300)])  # 300 > one 256-thread sweep
def test_rms_norm(impl, rng, T, D):
    k = impl(CH03)
    x, w = normal(rng, T, D), normal(rng, D)
    np.testing.assert_allclose(k.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), rtol=RTOL, atol=1e-6)


@pytest.mark.ch03_rmsnorm
def test_rms_norm_zero_row_is_finite(impl):
    k = impl(CH03)
    x, w = np.zeros((2, 5), np.float32), np.ones(5, np.float32)
    np.testing.assert_array_equal(k.rms_norm(x, w, 1e-6), np.zeros((2, 5), np.float32))


# -----------------------------------------------------------------------------------------------
# The matmul ladder and linear


@pytest.mark.parametrize("name", ["matmul_naive", "matmul_register_tiled", "matmul"])
@pytest.mark.parametrize("M, K, N", [(1, 1, 1), (5, 7, 3), (33, 17, 35)])  # 32-tiles overhang by 1-3
def test_matmul_ladder(rng, name, M, K, N):
    a, b = normal(rng, M, K), normal(rng, K, N)
    np.testing.assert_allclose(getattr(gpu, name)(a, b), reference.matmul(a, b), rtol=RTOL, atol=DOT_ATOL)


@pytest.mark.parametrize("T", [1, 3, 9])  # warp-per-output for T <= 8, tiled beyond
@pytest.mark.parametrize("K, N", [(1, 1), (37, 5)])
def test_linear(rng, T, K, N):
    x, w = normal(rng, T, K), normal(rng, N, K)
    np.testing.assert_allclose(gpu.linear(x, w), reference.linear(x, w), rtol=RTOL, atol=DOT_ATOL)


def test_shape_errors_name_the_problem(rng):
    with pytest.raises(ValueError, match="inner sizes"):
        gpu.matmul(normal(rng, 2, 3), normal(rng, 4, 2))
    with pytest.raises(ValueError, match="in="):
        gpu.linear(normal(rng, 2, 3), normal(rng, 4, 2))
    with pytest.raises(ValueError, match="embedding ids"):
        gpu.embedding(np.array([0, 7]), normal(rng, 7, 3))


# -----------------------------------------------------------------------------------------------
# Row and elementwise operators


def test_embedding(rng):
    table = normal(rng, 11, 37)
    ids = np.array([3, 0, 10, 3])  # first row, last row, a repeat
    np.testing.assert_array_equal(gpu.embedding(ids, table), reference.embedding(ids, table))


@pytest.mark.parametrize("shape", [(1, 1), (3, 37), (2, 3, 7)])
def test_softmax(rng, shape):
    x = normal(rng, *shape, scale=30.0)  # exp(30 * N(0,1)) overflows without the max subtraction
    got = gpu.softmax(x)
    np.testing.assert_allclose(got, reference.softmax(x), rtol=RTOL, atol=1e-7)
    np.testing.assert_allclose(got.sum(axis=-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("style", ["half", "pairs"])
@pytest.mark.parametrize("head_dim", [2, 8])
def test_rope(rng, style, head_dim):
    cos, sin = gpu.rope_table(head_dim, 20, 10000.0)
    x = normal(rng, 3, 2, head_dim)
    before = x.copy()
    positions = np.array([0, 7, 19])  # the first and the last position of the table
    np.testing.assert_allclose(gpu.rope(x, positions, cos, sin, style), reference.rope(x, positions, cos, sin, style),
                               rtol=RTOL, atol=1e-6)
    np.testing.assert_array_equal(x, before)  # the host array is not touched


def test_rope_table_is_the_reference():
    for got, want in zip(gpu.rope_table(8, 16, 1e5), reference.rope_table(8, 16, 1e5)):
        np.testing.assert_array_equal(got, want)


# The simulator computes exp(100) as a Python float and warns when casting inf to float32; a GPU
# returns inf silently. Either way the quotient is -0.
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("shape", [(1, 1), (3, 37)])
def test_silu_and_swiglu(rng, shape):
    gate, up = normal(rng, *shape, scale=5.0), normal(rng, *shape)
    gate.flat[0] = -100.0  # exp(100) overflows float32: the result must still be -0, not nan
    np.testing.assert_allclose(gpu.silu(gate), reference.silu(gate), rtol=RTOL, atol=1e-7)
    np.testing.assert_allclose(gpu.swiglu(gate, up), reference.swiglu(gate, up), rtol=RTOL, atol=1e-7)


# -----------------------------------------------------------------------------------------------
# Attention: one block per (query, head)

ATTENTION_CASES = [
    # T, H, Hkv, Dh, S, start
    (3, 2, 2, 8, 6, 2),  # n_kv_heads == n_heads, spare keys past start + T are ignored
    (2, 3, 1, 5, 2, 0),  # one kv head for three query heads; odd head_dim; keys from 0
    (1, 2, 1, 40, 37, 36),  # 37 keys: three warps merge their partial softmaxes; Dh > one warp
    (2, 9, 3, 64, 4, 2),  # SmolLM2's heads: 9 query heads in groups of 3, head_dim 64
]


@pytest.mark.parametrize("T, H, Hkv, Dh, S, start", ATTENTION_CASES)
def test_attention(rng, T, H, Hkv, Dh, S, start):
    q, k, v = normal(rng, T, H, Dh), normal(rng, S, Hkv, Dh), normal(rng, S, Hkv, Dh)
    np.testing.assert_allclose(gpu.attention(q, k, v, start), reference.attention(q, k, v, start),
                               rtol=RTOL, atol=DOT_ATOL)


@pytest.mark.parametrize("H, Hkv, kv_len", [(2, 2, 1), (3, 1, 5), (2, 1, 37)])
def test_attention_decode(rng, H, Hkv, kv_len):
    Dh, S = 8, 37
    q, k, v = normal(rng, H, Dh), normal(rng, S, Hkv, Dh), normal(rng, S, Hkv, Dh)
    want = reference.attention_decode(q, k, v, kv_len, scale=0.5)
    np.testing.assert_allclose(gpu.attention_decode(q, k, v, kv_len, scale=0.5), want, rtol=RTOL, atol=DOT_ATOL)


# -----------------------------------------------------------------------------------------------
# Quantized weights: the oracle is the NumPy dequantization of the same packed bytes


@pytest.fixture(params=["Q8_0", "Q4_0", "Q4_1"])
def qmatrix(request, rng):
    return quantize(normal(rng, 5, 64), request.param)  # 5 rows (a block of 4 warps + 1), 2 blocks


def test_dequantize(qmatrix):
    np.testing.assert_array_equal(gpu.dequantize(qmatrix), dequantize_reference(qmatrix))


@pytest.mark.parametrize("T", [1, 2, 8, 9])  # the fused matvec for T <= 8, the dequantize-in-tile kernel beyond
def test_qlinear(rng, qmatrix, T):
    x = normal(rng, T, 64)
    want = x @ dequantize_reference(qmatrix).T
    np.testing.assert_allclose(gpu.qlinear(x, qmatrix), want, rtol=RTOL, atol=DOT_ATOL)


def test_qmatvec(rng, qmatrix):
    x = normal(rng, 64)
    np.testing.assert_allclose(gpu.qmatvec(x, qmatrix), dequantize_reference(qmatrix) @ x, rtol=RTOL, atol=DOT_ATOL)


def test_qembedding(qmatrix):
    ids = np.array([4, 0, 4])
    np.testing.assert_array_equal(gpu.qembedding(ids, qmatrix), dequantize_reference(qmatrix)[ids])
    with pytest.raises(IndexError, match="token id 5"):
        gpu.qembedding(np.array([5]), qmatrix)


# -----------------------------------------------------------------------------------------------
# Beyond the simulator: every kernel compiles for a real GPU, and no-CUDA fails clearly
#
# The simulator runs kernels as Python: it never type-checks them the way Numba's CUDA compiler
# does (constant shared-array shapes, no Python objects, ...). So a child process *without* the
# simulator runs the compiler's front half - type inference and lowering to NVVM IR for an sm_80
# GPU - which needs neither a GPU nor the CUDA toolkit.


def kernel_signatures() -> list[tuple]:
    """Each kernel with the argument types its host wrapper launches it with, and the strided views
    (any layout: "A") the resident backend launches some of them with."""
    import numba.cuda.types as t

    from minillm.kernels.cuda import contiguous_attention as cuda_attention
    from minillm.kernels.cuda import basics as cuda_basics
    from minillm.kernels.cuda import matmul_ladder as cuda_matmul
    from minillm.kernels.cuda import ops as cuda_ops
    from minillm.kernels.cuda import paged_attention as cuda_paged_attention
    from minillm.kernels.cuda import quant as cuda_quant
    from minillm.kernels.cuda import tensor as cuda_tensor

    a2, a3 = t.float32[:, :], t.float32[:, :, :]  # views: a slice of qkv, a column half of gate_up
    f1, f2, f3, f4 = t.float32[::1], t.float32[:, ::1], t.float32[:, :, ::1], t.float32[:, :, :, ::1]
    i1, u2, h2, n2 = t.int64[::1], t.uint8[:, ::1], t.float16[:, ::1], t.int32[:, ::1]
    return [
        (cuda_basics.vector_add_kernel, (f1, f1, f1)),
        (cuda_basics.sum_kernel, (f1, f1)),
        (cuda_matmul.matmul_naive_kernel, (f2, f2, f2)),
        (cuda_matmul.matmul_tiled_kernel, (f2, f2, f2)),
        (cuda_matmul.matmul_register_tiled_kernel, (f2, f2, f2)),
        (cuda_matmul.linear_matvec_kernel, (f2, f2, f2)),
        (cuda_matmul.linear_tiled_kernel, (f2, f2, f2)),
        (cuda_ops.embedding_kernel, (i1, f2, f2)),
        (cuda_ops.rms_norm_kernel, (f2, f1, t.float32, f2)),
        (cuda_ops.softmax_kernel, (f2, f2)),
        (cuda_ops.rope_kernel, (f3, i1, f2, f2, t.int64)),
        (cuda_ops.silu_kernel, (f1, f1)),
        (cuda_ops.swiglu_kernel, (f1, f1, f1)),
        (cuda_attention.attention_kernel, (f3, f3, f3, t.int64, t.float32, f3)),
        (cuda_paged_attention.paged_attention_kernel, (f3, f4, f4, n2, i1, i1, t.float32, f3)),
        (cuda_quant.qmatvec_kernel, (f2, u2, h2, t.int64, f2)),
        (cuda_quant.dequantize_kernel, (u2, h2, t.int64, f2)),
        (cuda_quant.qembedding_kernel, (i1, u2, h2, t.int64, f2)),
        (cuda_quant.qlinear_tiled_kernel, (f2, u2, h2, t.int64, f2)),
        (cuda_ops.swiglu_rows_kernel, (a2, a2, f2)),
        (cuda_ops.rope_kernel, (a3, i1, f2, f2, t.int64)),
        (cuda_ops.rms_norm_kernel, (a2, f1, t.float32, f2)),
        (cuda_paged_attention.write_kv_kernel, (f4, f4, a3, a3, i1)),
        (cuda_paged_attention.paged_attention_kernel, (a3, f4, f4, n2, i1, i1, t.float32, f3)),
        (cuda_tensor.copy2_kernel, (a2, a2)),
        (cuda_tensor.copy3_kernel, (a3, a3)),
        (cuda_tensor.add2_kernel, (f2, f2, f2)),
    ]


def compile_every_kernel() -> None:
    """Run in a process without the simulator: type-infer and lower each kernel for sm_80."""
    import numba.cuda.dispatcher
    import numba.cuda.types as t
    from numba.cuda.compiler import compile_cuda

    # Device functions ask the current device for its compute capability; there is none here.
    numba.cuda.dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(8, 0))
    for kernel, argtypes in kernel_signatures():
        compile_cuda(kernel.py_func, t.void, argtypes, cc=(8, 0))
        print("compiled", kernel.py_func.__name__)


def run_without_simulator(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    here = os.path.dirname(os.path.abspath(__file__))
    return subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r}); {code}"],
                          env=env, capture_output=True, text=True, timeout=600)


def test_every_kernel_compiles_for_a_real_gpu():
    done = run_without_simulator("import test_kernels_cuda as t; t.compile_every_kernel()")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == len(kernel_signatures())


def test_without_gpu_or_simulator_the_error_says_why():
    done = run_without_simulator(
        "import numpy as np, minillm.kernels.cuda as c\n"
        "ok, reason = c.cuda_available(); print(ok, reason)\n"
        "if not ok:\n"
        "    try: c.softmax(np.ones((1, 2), np.float32))\n"
        "    except RuntimeError as e: print('raised', e)\n"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    if done.stdout.startswith("False"):  # no GPU on this machine: the reason, twice
        assert "no GPU found and NUMBA_ENABLE_CUDASIM is not set" in done.stdout
        assert "raised CUDA is unavailable" in done.stdout
    else:
        assert done.stdout.startswith("True GPU: ")


# -----------------------------------------------------------------------------------------------
# The whole model on the "cuda" backend: a tiny Llama with packed weights, prefill then decode,
# against the same model on the NumPy reference backend


def tiny_quantized_model_weights(config, rng):
    from minillm.model.layers import LayerWeights
    from minillm.model.transformer import ModelWeights

    D, F, V = config.hidden_size, config.intermediate_size, config.vocab_size
    q_rows, kv_rows = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim

    def packed(rows, cols):
        return quantize(normal(rng, rows, cols, scale=0.3), "Q4_1")

    layers = [LayerWeights(attn_norm=1 + normal(rng, D, scale=0.1), wq=packed(q_rows, D), wk=packed(kv_rows, D),
                           wv=packed(kv_rows, D), wo=packed(D, q_rows), mlp_norm=1 + normal(rng, D, scale=0.1),
                           w_gate=packed(F, D), w_up=packed(F, D), w_down=packed(D, F))
              for _ in range(config.n_layers)]
    embedding = quantize(normal(rng, V, D), "Q8_0")  # tied: also the LM head, as in SmolLM2
    return ModelWeights(embedding=embedding, layers=layers, final_norm=1 + normal(rng, D, scale=0.1),
                        lm_head=embedding)


def test_tiny_model_prefill_and_decode_match_the_reference_backend(rng):
    from minillm.kernels.registry import get_backend
    from minillm.model.config import ModelConfig
    from minillm.model.kv_cache import AttentionMetadata
    from minillm.model.transformer import Model

    config = ModelConfig(architecture="llama", n_layers=1, hidden_size=32, intermediate_size=32, n_heads=2,
                         n_kv_heads=1, head_dim=16, rope_theta=10000.0, rope_style="pairs", rms_eps=1e-5,
                         vocab_size=64, tied_embeddings=True, qk_norm=False, context_length=16)
    weights = tiny_quantized_model_weights(config, rng)
    logits = {}
    for backend in ("reference", "cuda"):
        model = Model(config, weights, get_backend(backend))
        cache = model.new_cache(n_slots=1, max_len=8)
        prefill = AttentionMetadata(query_lens=[3], context_lens=[0], seq_slots=[0])
        decode = AttentionMetadata(query_lens=[1], context_lens=[3], seq_slots=[0])
        logits[backend] = [model.forward(np.array([5, 17, 63]), prefill, cache),
                           model.forward(np.array([42]), decode, cache)]  # (1, V) each
    for got, want in zip(logits["cuda"], logits["reference"]):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=DOT_ATOL)


def test_model_kernel_runs_take_their_shapes_from_the_config_and_compute_what_they_count():
    """The kernel-benchmark runs are built from a ModelConfig: a tiny one gives tiny kernels whose
    outputs equal the reference and whose FLOP counts follow from the config's shapes."""
    from minillm.kernels.cuda import timing as cuda_timing
    from minillm.model.config import ModelConfig

    config = ModelConfig(architecture="llama", n_layers=1, hidden_size=32, intermediate_size=48, n_heads=4,
                         n_kv_heads=2, head_dim=8, rope_theta=10000.0, rope_style="half", rms_eps=1e-5,
                         vocab_size=40, tied_embeddings=True, qk_norm=False, context_length=16)
    runs = {run.name: run for run in cuda_timing.model_kernel_runs(config, tokens=3, context=5)}
    linear = runs["linear fp32 32->48"]
    assert linear.flops == 2 * 3 * 48 * 32
    x, w = (a.copy_to_host() for a in linear.args)  # (3, 32), (48, 32)
    np.testing.assert_allclose(linear.run().copy_to_host(), reference.linear(x, w), rtol=RTOL, atol=DOT_ATOL)
    head = runs["lm head qlinear Q8_0 32->40"]
    assert head.flops == 2 * 40 * 32
    attention = runs["attention"]
    assert attention.flops == 4 * 4 * 8 * (3 * 2 + 3 * 4 / 2)  # 4 FLOPs per (key seen, dim) per head, causal
