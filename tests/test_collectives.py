"""The all-reduce microbenchmark against NumPy, the alpha-beta fit against points made from known
alpha and beta, and the bytes a token costs under tensor parallelism against a hand computation."""
import numpy as np
import pytest

from minillm.hardware import collectives, devices
from minillm.hardware.collectives import AlphaBeta, fit_alpha_beta, ring_allreduce_bytes_per_rank, tp_communication


def test_allreduce_over_two_processes_equals_the_numpy_sum():
    rows = np.random.default_rng(0).standard_normal((2, 37)).astype(np.float32)  # (ranks, values)
    # 4 B and 4 MiB: far enough apart that the fit's slope is positive on a busy machine too
    sweep = collectives.allreduce_sweep(world_size=2, sizes=(4, 4 << 20), repeats=2, calls_per_sample=2, check=rows)
    np.testing.assert_allclose(sweep.check, rows.sum(axis=0), rtol=1e-6)
    assert sweep.message_bytes == [4, 4 << 20] and len(sweep.median_seconds) == 2
    assert all(t > 0 for t in sweep.median_seconds)


def test_alpha_beta_fit_recovers_alpha_and_beta_from_exact_points():
    alpha, beta = 25e-6, 3.5e9
    sizes = np.array([4, 64, 1024, 2**16, 2**20, 2**24], dtype=np.float64)
    fit = fit_alpha_beta(sizes, alpha + sizes / beta)
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-9)
    assert fit.beta_bytes_per_s == pytest.approx(beta, rel=1e-9)


@pytest.mark.parametrize("sizes, times, words", [
    ([1024], [1e-5], "at least 2"),
    ([1024, 1024], [1e-5, 2e-5], "two distinct"),
    ([4, 1024, 4096], [3e-5, 2e-5, 1e-5], "does not grow"),
    ([4, 1024], [0.0, 1e-5], "positive"),
])
def test_alpha_beta_fit_names_what_is_wrong_with_its_points(sizes, times, words):
    with pytest.raises(ValueError, match=words):
        fit_alpha_beta(sizes, times)


def test_ring_allreduce_moves_two_n_minus_one_over_n_of_the_message():
    assert ring_allreduce_bytes_per_rank(1000, 1) == 0
    assert ring_allreduce_bytes_per_rank(1000, 2) == 1000
    assert ring_allreduce_bytes_per_rank(1000, 4) == 1500
    with pytest.raises(ValueError, match="world_size"):
        ring_allreduce_bytes_per_rank(1000, 0)


def test_smollm2_decode_step_communication_by_hand():
    # SmolLM2-135M: D = 576, 30 layers; one token's all-reduce carries 576 fp32 = 2304 bytes,
    # 2 per layer = 60 per step; a ring of 2 ranks sends 2*(2-1)/2 = 1x the message per rank.
    link = AlphaBeta(alpha_s=10e-6, beta_bytes_per_s=1e9)
    two = tp_communication(hidden_size=576, n_layers=30, world_size=2, link=link)
    assert two.allreduces_per_step == 60
    assert two.message_bytes == 2304
    assert two.bytes_per_rank_per_step == 60 * 2304
    assert two.seconds_per_step == pytest.approx(60 * (10e-6 + 2304 / 1e9))
    four = tp_communication(hidden_size=576, n_layers=30, world_size=4, link=link, tokens=8)
    assert four.message_bytes == 8 * 2304  # a prefill of 8 tokens: 8 rows per all-reduce
    assert four.bytes_per_rank_per_step == 60 * 1.5 * 8 * 2304
    assert tp_communication(576, 30, 1, link).seconds_per_step == 0  # one rank talks to no one


def test_interconnect_figures_are_the_data_sheets_halved_per_direction():
    assert devices.NVLINK4_H100.bytes_per_s_per_direction == 450e9
    assert devices.PCIE4_X16.bytes_per_s_per_direction == 32e9
    with pytest.raises(ValueError, match="bidirectional"):
        devices.InterconnectSpec("broken", 0)


def test_sweep_refuses_bad_arguments_before_starting_processes():
    with pytest.raises(ValueError, match="world_size"):
        collectives.allreduce_sweep(world_size=1)
    with pytest.raises(ValueError, match="backend"):
        collectives.allreduce_sweep(backend="mpi")
    with pytest.raises(ValueError, match="multiples"):
        collectives.allreduce_sweep(sizes=(6,))
    with pytest.raises(ValueError, match="shape"):
        collectives.allreduce_sweep(check=np.zeros((3, 2)))
