"""Chapter 02: the Numba CPU kernels against the NumPy specification, and the specification
against PyTorch and transformers.

Inputs are random float32 at SmolLM2-135M shapes (hidden 576, FFN 1536, 9 query heads and 3 kv
heads of 64) and at awkward ones (size 1, odd and prime sizes, non-multiples of every tile).
Tolerances are relative to the largest reference value, per operator:
    1e-5  rms_norm, rope, silu/swiglu, softmax, attention, attention_decode (and the spec vs torch)
    1e-5  matmul/linear (fastmath reorders the K-sums; error grows like sqrt(K) * 6e-8)
    3e-7  fast_exp vs np.exp, elementwise; exact: embedding (a copy); 1e-7 absolute: rope_table
The first run compiles every kernel (tens of seconds); Numba's cache makes later runs fast.
"""
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from minillm.kernels import cpu, reference, registry
from minillm.kernels.cpu import rows as cpu_rows
from minillm.kernels.cpu.quant import dequantize_reference, quantize

D, FFN, H, HKV, DH, THETA = 576, 1536, 9, 3, 64, 100000.0


def rand(*shape, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def assert_close(actual, expected, tol=1e-5):
    assert actual.shape == expected.shape and actual.dtype == np.float32
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * max(np.abs(expected).max(), 1e-30))


def pair_permutation(head_dim):
    """Row order of a GGUF llama head: pairs-row 2i + t holds half-row i + t * head_dim / 2."""
    return np.array([i + t * head_dim // 2 for i in range(head_dim // 2) for t in (0, 1)])


# -----------------------------------------------------------------------------
# chapter 02 exercises (graded on the package or on exercises/ch02_cpu_kernels.py)

NORM_SHAPES = [(1, D), (5, D), (300, D), (1, 1), (3, 7), (130, 257)]


@pytest.mark.ch02_rmsnorm
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm_matches_the_reference(impl, shape):
    ops = impl("ch02_cpu_kernels")
    x, w = rand(*shape, seed=1, scale=3.0), rand(shape[1], seed=2)
    assert_close(ops.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))


@pytest.mark.ch02_rmsnorm
def test_rms_norm_matches_torch_and_keeps_zero_rows_finite(impl):
    ops = impl("ch02_cpu_kernels")
    x, w = rand(7, D, seed=3), rand(D, seed=4)
    x[2] = 0.0
    expected = F.rms_norm(torch.from_numpy(x), (D,), torch.from_numpy(w), 1e-5).numpy()
    out = ops.rms_norm(x, w, 1e-5)
    assert_close(out, expected)
    assert np.all(out[2] == 0.0)


SOFTMAX_SHAPES = [(1, 1), (1, 7), (4, 256), (3, 257), (1, 49152), (2, 3, 513)]


@pytest.mark.ch02_softmax
@pytest.mark.parametrize("shape", SOFTMAX_SHAPES)
def test_softmax_matches_the_reference_and_torch(impl, shape):
    ops = impl("ch02_cpu_kernels")
    x = rand(*shape, seed=5, scale=4.0)
    out = ops.softmax(x)
    assert_close(out, reference.softmax(x))
    assert_close(out, torch.softmax(torch.from_numpy(x), dim=-1).numpy())


@pytest.mark.ch02_softmax
def test_softmax_gives_masked_logits_zero_and_survives_huge_ones(impl):
    ops = impl("ch02_cpu_kernels")
    x = np.array([[-np.inf, 1.0, 2.0, -np.inf], [1e4, -1e4, 0.0, 1e4]], dtype=np.float32)
    out = ops.softmax(x)
    assert out[0, 0] == 0.0 and out[0, 3] == 0.0
    np.testing.assert_allclose(out[0, 1:3], [1 / (1 + math.e), math.e / (1 + math.e)], rtol=1e-6)
    np.testing.assert_allclose(out[1], [0.5, 0.0, 0.0, 0.5], rtol=1e-6, atol=1e-30)
    # a masked first chunk (the online max starts at -inf) before finite logits
    long = np.full((1, 600), -np.inf, dtype=np.float32)
    long[0, 500:] = rand(100, seed=6)
    assert_close(ops.softmax(long), reference.softmax(long))


# logits on a grid of 1/64 up to +-1e4: adding an integer is then exact in float32
logit_rows = hnp.arrays(
    np.float32, st.tuples(st.integers(1, 4), st.integers(1, 700)),
    elements=st.integers(-640_000, 640_000).map(lambda i: i / 64),
)


@pytest.mark.ch02_softmax
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])  # no shrinking: minutes on 700-float rows
@given(x=logit_rows, shift=st.integers(-1000, 1000))
def test_softmax_properties(impl, x, shift):
    """Rows sum to 1, nothing overflows at +-1e4, and adding a constant to every logit changes nothing."""
    ops = impl("ch02_cpu_kernels")
    p = ops.softmax(x)
    assert np.all(np.isfinite(p)) and np.all(p >= 0)
    np.testing.assert_allclose(p.sum(axis=-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(ops.softmax(x + np.float32(shift)), p, rtol=1e-5, atol=1e-12)


ROPE_CASES = [(1, H, DH), (3, HKV, DH), (70, H, DH), (5, 1, 2), (4, 2, 6)]


@pytest.mark.ch02_rope
@pytest.mark.parametrize("style", ["half", "pairs"])
@pytest.mark.parametrize("shape", ROPE_CASES)
def test_rope_matches_the_reference(impl, shape, style):
    ops = impl("ch02_cpu_kernels")
    x = rand(*shape, seed=7)
    cos, sin = reference.rope_table(shape[2], 4096, THETA)
    positions = np.random.default_rng(8).integers(0, 4096, shape[0])
    assert_close(ops.rope(x.copy(), positions, cos, sin, style), reference.rope(x, positions, cos, sin, style))


@pytest.mark.ch02_rope
def test_rope_pairs_is_half_on_permuted_rows(impl):
    """GGUF llama files store each head's Q/K rows permuted so that adjacent pairs rotate together."""
    ops = impl("ch02_cpu_kernels")
    x = rand(6, H, DH, seed=9)
    cos, sin = reference.rope_table(DH, 64, THETA)
    positions = np.arange(10, 16)
    perm = pair_permutation(DH)
    half = ops.rope(x.copy(), positions, cos, sin, "half")                     # (T, H, Dh)
    pairs = ops.rope(np.ascontiguousarray(x[..., perm]), positions, cos, sin, "pairs")
    assert_close(pairs, np.ascontiguousarray(half[..., perm]))


MATMUL_SHAPES = [(1, 1, 1), (1, 576, 1536), (5, 7, 3), (67, 129, 65), (64, 576, 192), (4, 1536, 8)]


@pytest.mark.ch02_tiled_matmul
@pytest.mark.parametrize("m,k,n", MATMUL_SHAPES)
def test_blocked_matmul_matches_numpy(impl, m, k, n):
    ops = impl("ch02_cpu_kernels")
    a, b = rand(m, k, seed=10), rand(k, n, seed=11)
    expected = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)
    assert_close(ops.matmul_v3_blocked(a, b), expected)


DECODE_CASES = [  # (S buffer, kv_len, H, Hkv, Dh)
    (1, 1, H, HKV, DH), (40, 17, H, HKV, DH), (700, 600, H, HKV, DH), (1100, 1024, H, HKV, DH),
    (9, 9, 4, 4, 8), (300, 299, 6, 1, 5),
]


@pytest.mark.ch02_decode_attention
@pytest.mark.parametrize("S,kv_len,n_heads,n_kv,head_dim", DECODE_CASES)
def test_attention_decode_matches_the_reference(impl, S, kv_len, n_heads, n_kv, head_dim):
    ops = impl("ch02_cpu_kernels")
    q, k, v = rand(n_heads, head_dim, seed=12), rand(S, n_kv, head_dim, seed=13), rand(S, n_kv, head_dim, seed=14)
    k[kv_len:] = 1e6  # stale buffer past kv_len must be ignored
    assert_close(ops.attention_decode(q, k, v, kv_len), reference.attention_decode(q, k, v, kv_len))


@pytest.mark.ch02_decode_attention
def test_attention_decode_matches_torch_with_a_given_scale(impl):
    ops = impl("ch02_cpu_kernels")
    q, k, v = rand(H, DH, seed=15), rand(200, HKV, DH, seed=16), rand(200, HKV, DH, seed=17)
    tq = torch.from_numpy(q)[None, :, None]                                        # (1, H, 1, Dh)
    tk, tv = (torch.from_numpy(a[:150]).transpose(0, 1)[None] for a in (k, v))    # (1, Hkv, 150, Dh)
    expected = F.scaled_dot_product_attention(tq, tk, tv, scale=0.3, enable_gqa=True)[0, :, 0].numpy()
    assert_close(ops.attention_decode(q, k, v, 150, scale=0.3), expected)


# -----------------------------------------------------------------------------
# the specification against PyTorch and transformers


def torch_attention(q, k, v, start, scale=None):
    """The oracle: SDPA over the first start + T keys with an explicit causal mask for the offset."""
    T, L = q.shape[0], start + q.shape[0]
    tq = torch.from_numpy(q).transpose(0, 1)[None]                         # (1, H, T, Dh)
    tk, tv = (torch.from_numpy(a[:L]).transpose(0, 1)[None] for a in (k, v))  # (1, Hkv, L, Dh)
    visible = torch.arange(L)[None, :] <= start + torch.arange(T)[:, None]  # (T, L)
    out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=visible, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).numpy()                                  # (T, H, Dh)


ATTENTION_CASES = [  # (T, start, S buffer, H, Hkv, Dh)
    (1, 0, 1, H, HKV, DH), (1, 40, 50, H, HKV, DH), (7, 0, 7, H, HKV, DH), (33, 100, 140, H, HKV, DH),
    (130, 0, 130, H, HKV, DH), (5, 3, 8, 4, 4, 8), (40, 10, 60, 6, 1, 5),
]


@pytest.mark.parametrize("T,start,S,n_heads,n_kv,head_dim", ATTENTION_CASES)
def test_reference_attention_matches_torch(T, start, S, n_heads, n_kv, head_dim):
    q, k, v = rand(T, n_heads, head_dim, seed=18), rand(S, n_kv, head_dim, seed=19), rand(S, n_kv, head_dim, seed=20)
    assert_close(reference.attention(q, k, v, start), torch_attention(q, k, v, start))


def test_reference_attention_decode_is_attention_of_the_last_position():
    q, k, v = rand(H, DH, seed=21), rand(50, HKV, DH, seed=22), rand(50, HKV, DH, seed=23)
    assert_close(reference.attention_decode(q, k, v, 30, scale=0.2), torch_attention(q[None], k, v, 29, scale=0.2)[0])


def test_reference_rms_norm_matches_torch():
    x, w = rand(11, D, seed=24), rand(D, seed=25)
    expected = F.rms_norm(torch.from_numpy(x), (D,), torch.from_numpy(w), 1e-6).numpy()
    assert_close(reference.rms_norm(x, w, 1e-6), expected)


def test_rope_table_matches_a_float64_derivation():
    cos, sin = reference.rope_table(DH, 2048, THETA)
    inv_freq = 1.0 / THETA ** (torch.arange(0, DH, 2, dtype=torch.float64) / DH)   # (Dh/2,)
    angles = torch.arange(2048, dtype=torch.float64)[:, None] * inv_freq[None]    # (P, Dh/2)
    assert cos.dtype == sin.dtype == np.float32 and cos.shape == (2048, DH // 2)
    np.testing.assert_allclose(cos, torch.cos(angles).numpy(), atol=1e-7)
    np.testing.assert_allclose(sin, torch.sin(angles).numpy(), atol=1e-7)


def test_reference_rope_half_matches_transformers():
    # imported here: only this test needs it, and it costs ~15 s of every ch02 course.check
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x = rand(12, H, DH, seed=26)
    cos, sin = reference.rope_table(DH, 512, THETA)
    positions = np.random.default_rng(27).integers(0, 512, 12)
    hf_cos = torch.from_numpy(np.concatenate([cos, cos], axis=-1)[positions])[None]  # (1, T, Dh) HF's layout
    hf_sin = torch.from_numpy(np.concatenate([sin, sin], axis=-1)[positions])[None]
    tx = torch.from_numpy(x).transpose(0, 1)[None]                                   # (1, H, T, Dh)
    expected, _ = apply_rotary_pos_emb(tx, tx, hf_cos, hf_sin)
    assert_close(reference.rope(x, positions, cos, sin, "half"), expected[0].transpose(0, 1).numpy())


def test_reference_swiglu_and_softmax_match_torch():
    g, u = rand(5, FFN, seed=28, scale=5.0), rand(5, FFN, seed=29)
    assert_close(reference.swiglu(g, u), (F.silu(torch.from_numpy(g)) * torch.from_numpy(u)).numpy())
    assert_close(reference.softmax(g), torch.softmax(torch.from_numpy(g), -1).numpy())


# -----------------------------------------------------------------------------
# every Numba kernel against the specification


@pytest.mark.parametrize("T", [1, 2, 5, 127, 128, 130])
@pytest.mark.parametrize("n_in,n_out", [(D, FFN), (FFN, D), (D, HKV * DH), (33, 7), (1, 1)])
def test_linear_matches_the_reference_on_every_dispatch_path(T, n_in, n_out):
    x, w = rand(T, n_in, seed=30), rand(n_out, n_in, seed=31)
    expected = (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32)
    assert_close(cpu.linear(x, w), expected)
    assert_close(reference.linear(x, w), expected)


@pytest.mark.parametrize("rung", [cpu.matmul_v1_naive, cpu.matmul_v2_streaming, cpu.matmul_v3_blocked, cpu.matmul_v4_parallel, cpu.matmul])
@pytest.mark.parametrize("m,k,n", MATMUL_SHAPES)
def test_every_matmul_rung_matches_numpy(rung, m, k, n):
    a, b = rand(m, k, seed=32), rand(k, n, seed=33)
    expected = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)
    assert_close(rung(a, b), expected)
    assert_close(reference.matmul(a, b), expected)


@pytest.mark.parametrize("n_in,n_out", [(D, FFN), (FFN, D), (7, 13), (1, 1), (64, 8)])
def test_matvec_matches_numpy(n_in, n_out):
    x, w = rand(n_in, seed=34), rand(n_out, n_in, seed=35)
    assert_close(cpu.matvec(x, w), (w.astype(np.float64) @ x.astype(np.float64)).astype(np.float32))


@pytest.mark.parametrize("shape", [(1, FFN), (7, 13), (300, FFN), (1, 1)])
def test_swiglu_and_silu_match_the_reference(shape):
    g, u = rand(*shape, seed=36, scale=5.0), rand(*shape, seed=37)
    assert_close(cpu.swiglu(g, u), reference.swiglu(g, u))
    assert_close(cpu.silu(g), reference.silu(g))


@pytest.mark.parametrize("rows", [6, 300])  # the serial and the parallel kernel
def test_swiglu_on_column_slices_of_one_projection(rows):
    fused = rand(rows, 2 * FFN, seed=38, scale=3.0)
    gate, up = fused[:, :FFN], fused[:, FFN:]  # views with a row stride of 2F
    assert_close(cpu.swiglu(gate, up), reference.swiglu(gate, up))


def test_silu_extremes():
    x = np.array([-1e4, -100.0, -88.5, -20.0, 0.0, 20.0, 100.0, 1e4], dtype=np.float32)
    with np.errstate(over="ignore"):
        expected = (x / (1 + np.exp(-x.astype(np.float64)))).astype(np.float32)
    np.testing.assert_allclose(cpu.silu(x), expected, rtol=1e-6, atol=1e-30)


def test_fast_exp_matches_numpy_over_the_float32_range():
    x = np.concatenate([np.linspace(-87.3, 88.3, 400_001), [-np.inf, -1e4, -88.0, 0.0, 89.0, 1e4, np.inf]]).astype(np.float32)
    out = cpu_rows.exp_rows(x)
    with np.errstate(over="ignore"):
        expected = np.exp(x.astype(np.float64))
    normal = np.abs(x) < 87.3
    np.testing.assert_allclose(out[normal], expected[normal], rtol=3e-7)
    assert list(out[-7:]) == [0.0, 0.0, 0.0, 1.0, np.inf, np.inf, np.inf]


@pytest.mark.parametrize("shape", [(300, D), (2, 5, 64)])
def test_rms_norm_on_many_rows_and_leading_axes(shape):
    x, w = rand(*shape, seed=39), rand(shape[-1], seed=40)
    assert_close(cpu.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("style", ["half", "pairs"])
def test_rope_rotates_in_place_on_the_parallel_path(style):
    x = rand(600, H, DH, seed=41)
    cos, sin = reference.rope_table(DH, 8192, THETA)
    positions = np.arange(7000, 7600)
    expected = reference.rope(x, positions, cos, sin, style)
    out = cpu.rope(x, positions, cos, sin, style)
    assert out is x
    assert_close(x, expected)


def test_rope_refuses_positions_outside_the_tables_without_touching_x():
    cos, sin = reference.rope_table(DH, 16, THETA)
    for positions in (np.array([3, 16]), np.array([-1, 2])):
        for x in (rand(2, H, DH, seed=45), rand(2000, H, DH, seed=45)[:2]):  # serial path, and a view
            before = x.copy()
            with pytest.raises(ValueError, match=r"positions must lie in \[0, 16\)"):
                cpu.rope(x, positions, cos, sin, "half")
            np.testing.assert_array_equal(x, before)


@pytest.mark.parametrize("T", [1, 3, 300])
def test_rope_rotates_a_strided_view_of_stacked_heads(T):
    """The model rotates q and k heads together, as a view of its stacked (T, H + 2Hkv, Dh) qkv."""
    qkv = rand(T, 15, DH, seed=46)
    cos, sin = reference.rope_table(DH, 512, THETA)
    positions = np.arange(100, 100 + T)
    expected = reference.rope(qkv[:, :12], positions, cos, sin, "pairs")
    v_before = qkv[:, 12:].copy()
    cpu.rope(qkv[:, :12], positions, cos, sin, "pairs")
    assert_close(qkv[:, :12], expected)
    np.testing.assert_array_equal(qkv[:, 12:], v_before)  # the v heads are left alone


@pytest.mark.parametrize("T,start,S,n_heads,n_kv,head_dim", ATTENTION_CASES)
def test_attention_matches_the_reference(T, start, S, n_heads, n_kv, head_dim):
    q, k, v = rand(T, n_heads, head_dim, seed=42), rand(S, n_kv, head_dim, seed=43), rand(S, n_kv, head_dim, seed=44)
    k[start + T:] = 1e6  # keys past start + T are ignored
    assert_close(cpu.attention(q, k, v, start), reference.attention(q, k, v, start))
    assert_close(cpu.attention(q, k, v, start, scale=0.05), reference.attention(q, k, v, start, scale=0.05))


def test_attention_decode_equals_prefill_attention_at_the_last_position():
    q, k, v = rand(H, DH, seed=45), rand(1000, HKV, DH, seed=46), rand(1000, HKV, DH, seed=47)
    assert_close(cpu.attention_decode(q, k, v, 1000), cpu.attention(q[None], k, v, 999)[0])


def test_embedding_gathers_rows():
    table, ids = rand(100, D, seed=48), np.array([5, 0, 99, 5])
    assert np.array_equal(cpu.embedding(ids, table), table[ids])


# -----------------------------------------------------------------------------
# bad input fails at once, naming the problem


@pytest.mark.parametrize("call,message", [
    (lambda: cpu.linear(rand(2, 5), rand(3, 6)), "in=5"),
    (lambda: cpu.matmul(rand(2, 5), rand(6, 3)), "inner sizes"),
    (lambda: cpu.rms_norm(rand(2, 5).astype(np.float64), rand(5), 1e-5), "float32"),
    (lambda: cpu.rope(rand(2, 3, 4), np.arange(2), *reference.rope_table(4, 8, THETA), "rotate"), "style"),
    (lambda: cpu.rope(rand(2, 3, 4), np.array([0, 8]), *reference.rope_table(4, 8, THETA), "half"), "positions"),
    (lambda: cpu.attention(rand(4, 9, 8), rand(5, 3, 8), rand(5, 3, 8), 2), "start 2"),
    (lambda: cpu.attention(rand(4, 9, 8), rand(5, 2, 8), rand(5, 2, 8), 0), "multiple"),
    (lambda: cpu.attention_decode(rand(9, 8), rand(5, 3, 8), rand(5, 3, 8), 6), "kv_len 6"),
    (lambda: cpu.embedding(np.array([0, 100]), rand(100, 4)), r"\[0, 100\)"),
])
def test_bad_input_is_refused_with_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# -----------------------------------------------------------------------------
# the registry


def test_backends_expose_every_op_and_agree():
    x, w = rand(3, 64, seed=49), rand(32, 64, seed=50)
    qm = quantize(rand(40, 64, seed=51), "Q8_0")
    ids = np.array([3, 0, 39])
    outs = {}
    for name in ("reference", "numba"):
        ops = registry.get_backend(name)
        assert all(callable(getattr(ops, op)) for op in registry.OPS)
        outs[name] = (ops.linear(x, w), ops.qlinear(x, qm), ops.qembedding(ids, qm))
    for ref_out, numba_out in zip(*outs.values()):
        assert_close(numba_out, ref_out)
    assert_close(outs["reference"][2], dequantize_reference(qm)[ids])
    assert registry.get_backend() is registry.get_backend("numba")


def test_registry_refuses_unknown_and_incomplete_backends():
    with pytest.raises(ValueError, match="unknown kernel backend 'tpu'"):
        registry.get_backend("tpu")
    with pytest.raises(TypeError, match="lacks qembedding"):
        registry.Backend("partial", {op: print for op in registry.OPS if op != "qembedding"})


def test_a_registered_backend_is_built_by_its_factory_on_every_call(monkeypatch):
    monkeypatch.setattr(registry, "_registered", {})  # this test's registrations only
    reference_ops = {op: getattr(reference, op) for op in registry.OPS}
    registry.register_backend("mine", lambda: registry.Backend("mine", reference_ops))
    first, second = registry.get_backend("mine"), registry.get_backend("mine")
    assert first is not second and first.name == "mine" and first.write_kv is reference.write_kv
    assert registry.backend_names() == ["reference", "numba", "cuda", "mine"]
    registry.register_backend("mine", lambda: registry.get_backend("numba"))  # a second registration replaces
    assert registry.get_backend("mine") is registry.get_backend("numba")
    registry.register_backend("broken", lambda: reference_ops)
    with pytest.raises(TypeError, match="'broken' returned dict, not a Backend"):
        registry.get_backend("broken")
    with pytest.raises(ValueError, match="'numba' is a built-in"):
        registry.register_backend("numba", lambda: registry.Backend("numba", reference_ops))
    with pytest.raises(TypeError, match="needs a callable"):
        registry.register_backend("mine", registry.Backend("mine", reference_ops))
    with pytest.raises(TypeError, match="lacks write_kv"):  # checked complete when built, K/V writes included
        registry.register_backend("partial", lambda: registry.Backend(
            "partial", {op: fn for op, fn in reference_ops.items() if op != "write_kv"}))
        registry.get_backend("partial")


def test_the_exercises_backend_before_the_course_registered_it_says_what_to_import(monkeypatch):
    monkeypatch.setattr(registry, "_registered", {})  # as in a process that has not imported minillm.course
    with pytest.raises(registry.BackendUnavailable, match=r"registered by minillm.course.*import minillm.course"):
        registry.get_backend("exercises")
    with pytest.raises(ValueError, match="unknown kernel backend 'tpu'; choose one of reference, numba, cuda$"):
        registry.get_backend("tpu")


def test_importing_the_kernels_registers_nothing_and_importing_the_course_registers_exercises():
    """In a fresh process: the kernels alone know no "exercises" backend; minillm.course brings it."""
    script = """
from minillm.kernels import registry
assert registry.backend_names() == ["reference", "numba", "cuda"], registry.backend_names()
import minillm.course
ops = registry.get_backend("exercises")
assert ops.name == "exercises" and ops.write_kv is registry.get_backend("numba").write_kv
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_cuda_backend_is_listed_only_when_it_can_run():
    available = registry.available_backends()
    assert available[:2] == ["reference", "numba"]
    if "cuda" in available:
        assert all(callable(getattr(registry.get_backend("cuda"), op)) for op in registry.OPS)
    else:
        with pytest.raises(registry.BackendUnavailable, match="cuda"):
            registry.get_backend("cuda")


def test_both_register_tiles_equal_numpy():
    from minillm.kernels.cpu import matmul_ladder as cpu_matmul

    rng = np.random.default_rng(7)
    a, bt = rng.standard_normal((4, 37)).astype(np.float32), rng.standard_normal((4, 37)).astype(np.float32)
    for tile, rows in ((cpu_matmul._tile_4x4, 4), (cpu_matmul._tile_2x4, 2)):
        c = np.zeros((4, 4), np.float32)
        tile(a, bt, c, 0, 0)
        np.testing.assert_allclose(c[:rows], a[:rows] @ bt.T, rtol=1e-5, atol=1e-5)


def test_the_avx2_code_path_takes_the_small_tile_and_still_multiplies_right():
    """On a 16-register target (AVX2) the matmul uses 2 x 4 tiles; compiled here for Haswell."""
    import os
    import subprocess
    import sys

    code = ("import numpy as np; from minillm.kernels.cpu import matmul_ladder as m\n"
            "assert m.TILE_ROWS == 2, m.TILE_ROWS\n"
            "rng = np.random.default_rng(0)\n"
            "for M, N, K in ((1, 1, 1), (7, 9, 33), (64, 130, 576)):\n"
            "    a, bt = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((N, K)).astype(np.float32)\n"
            "    assert np.allclose(m.matmul_nt_parallel(a, bt), a @ bt.T, rtol=1e-4, atol=1e-4), (M, N, K)\n")
    env = os.environ | {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": ""}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
