"""Symmetric int8 K/V (minillm.kernels.quant_kv, and chapter 04's task 3) against PyTorch's own
per-channel fake quantization: round(x / scale) clamped to -127..127, times scale."""
import numpy as np
import pytest
import torch

from minillm.kernels import quant_kv


def kv_block(seed, shape=(37, 3, 64)):
    """K/V-like vectors whose ranges differ by orders of magnitude from one (token, head) to the next."""
    rng = np.random.default_rng(seed)
    spread = rng.lognormal(0.0, 2.0, shape[:-1] + (1,))  # (..., 1) one range per vector
    return (rng.standard_normal(shape) * spread).astype(np.float32)


def torch_fake_quantize(x, scale):
    """PyTorch's int8 round trip of each vector (last axis) with the given scales -> (codes, values)."""
    flat = torch.tensor(x.reshape(-1, x.shape[-1]))                     # (vectors, Dh)
    s = torch.tensor(scale.reshape(-1), dtype=torch.float32)            # (vectors,)
    values = torch.fake_quantize_per_channel_affine(flat, s, torch.zeros(len(s), dtype=torch.int32), 0, -127, 127)
    values = values.numpy().reshape(x.shape)
    codes = np.rint(values / np.where(scale == 0, 1, scale)[..., None])
    return codes, values


@pytest.mark.ch04_kv_int8
@pytest.mark.parametrize("shape", [(37, 3, 64), (3, 64), (1, 1, 1), (5, 2, 7)])
def test_exercise_kv_int8_matches_torch(impl, shape):
    q = impl("ch04_quantization")
    x = kv_block(len(shape) * 10 + shape[-1], shape)
    codes, scale = q.quantize_kv_int8(x)
    assert codes.dtype == np.int8 and codes.shape == x.shape
    assert scale.dtype == np.float32 and scale.shape == x.shape[:-1]
    # The scale maps each vector's largest magnitude onto 127.
    np.testing.assert_allclose(scale, np.abs(x).max(axis=-1) / 127, rtol=1e-6)
    want_codes, want_values = torch_fake_quantize(x, scale)
    # Codes equal PyTorch's, except that x / scale computed another way may round the other side
    # of a tie: allowed only within 1e-3 of a half-integer, and by one step.
    ratio = x / np.where(scale == 0, 1, scale)[..., None]
    near_tie = np.abs(np.abs(ratio - np.trunc(ratio)) - 0.5) < 1e-3
    differs = codes != want_codes
    assert not (differs & ~near_tie).any() and np.abs(codes - want_codes).max() <= 1
    values = q.dequantize_kv_int8(codes, scale)
    assert values.dtype == np.float32 and values.shape == x.shape
    np.testing.assert_allclose(values[~differs], want_values[~differs], rtol=1e-6, atol=0)


@pytest.mark.ch04_kv_int8
def test_exercise_kv_int8_error_is_at_most_half_a_step(impl):
    q = impl("ch04_quantization")
    x = kv_block(7)
    codes, scale = q.quantize_kv_int8(x)
    err = np.abs(q.dequantize_kv_int8(codes, scale) - x)                          # (T, Hkv, Dh)
    assert (err <= scale[..., None] * (0.5 + 1e-5)).all()
    assert (np.abs(codes.astype(np.int32)).max(axis=-1) == 127).all()            # the extreme of each vector


@pytest.mark.ch04_kv_int8
def test_exercise_kv_int8_zero_vector_and_symmetry(impl):
    q = impl("ch04_quantization")
    x = kv_block(3, (4, 2, 16))
    x[1, 0] = 0.0                                 # an all-zero vector: scale 0, codes 0, no NaN
    codes, scale = q.quantize_kv_int8(x)
    assert scale[1, 0] == 0 and not codes[1, 0].any()
    assert np.isfinite(q.dequantize_kv_int8(codes, scale)).all()
    neg_codes, neg_scale = q.quantize_kv_int8(-x)  # symmetric: no zero point
    np.testing.assert_array_equal(neg_scale, scale)
    np.testing.assert_array_equal(neg_codes, -codes)


def test_kv_int8_refuses_bad_input():
    with pytest.raises(ValueError, match="float vectors"):
        quant_kv.quantize_kv_int8(np.ones((2, 4), dtype=np.int32))
    with pytest.raises(ValueError, match="finite"):
        quant_kv.quantize_kv_int8(np.array([[1.0, np.nan]], dtype=np.float32))
    codes, scale = quant_kv.quantize_kv_int8(kv_block(0, (3, 8)))
    with pytest.raises(ValueError, match="int8 codes"):
        quant_kv.dequantize_kv_int8(codes.astype(np.int16), scale)
    with pytest.raises(ValueError, match="int8 codes"):
        quant_kv.dequantize_kv_int8(codes, scale[:2])


def test_kv_bytes_per_vector():
    # SmolLM2's heads of 64: 256 bytes in fp32, 64 codes + a 4-byte scale in int8.
    assert quant_kv.kv_bytes_per_vector(64, "fp32") == 64 * np.dtype(np.float32).itemsize
    assert quant_kv.kv_bytes_per_vector(64, "int8") == 64 * np.dtype(np.int8).itemsize + np.dtype(np.float32).itemsize
    with pytest.raises(ValueError, match="unknown KV dtype"):
        quant_kv.kv_bytes_per_vector(64, "fp8")
