"""Chapter 12's exercises, graded against NumPy (package or stubs: --impl).

The column/row split of a linear pair runs every rank in one process: the all-reduce is a
function handed in that records what it receives and sums it, as torch.distributed's would.
"""
import numpy as np
import pytest

from minillm.model.sharding import shard_range


def silu(h):
    return h / (1 + np.exp(-h))


class RecordingAllReduce:
    """Sums the ranks' partials (what every rank holds after an all-reduce) and keeps them."""

    def __init__(self):
        self.calls = []

    def __call__(self, partials):
        self.calls.append([np.array(p) for p in partials])
        return np.sum(self.calls[-1], axis=0)


@pytest.mark.ch12_column_row_linear
@pytest.mark.parametrize("world_size, F", [(1, 12), (2, 12), (3, 12), (3, 10), (4, 7)])
@pytest.mark.parametrize("activation", [silu, np.tanh], ids=["silu", "tanh"])
def test_column_row_linear_equals_the_unsplit_product(impl, world_size, F, activation):
    rng = np.random.default_rng(world_size * 100 + F)
    N, D = 5, 8
    x = rng.standard_normal((N, D))
    w_in, w_out = rng.standard_normal((F, D)), rng.standard_normal((D, F))
    reduce = RecordingAllReduce()
    y = impl("ch12_scale_out").column_row_linear(x, w_in, w_out, world_size, reduce, activation)
    np.testing.assert_allclose(y, activation(x @ w_in.T) @ w_out.T, rtol=1e-10, atol=1e-10)
    assert len(reduce.calls) == 1, "one all-reduce for the whole pair"
    partials = reduce.calls[0]
    assert len(partials) == world_size and all(p.shape == (N, D) for p in partials)
    for rank, partial in enumerate(partials):  # each rank used only its own rows / columns
        start, stop = shard_range(F, world_size, rank)
        expected = activation(x @ w_in[start:stop].T) @ w_out[:, start:stop].T
        np.testing.assert_allclose(partial, expected, rtol=1e-10, atol=1e-10, err_msg=f"rank {rank}")


@pytest.mark.ch12_column_row_linear
def test_column_row_linear_refuses_no_ranks(impl):
    x, w = np.ones((1, 4)), np.ones((4, 4))
    with pytest.raises(ValueError, match="world_size"):
        impl("ch12_scale_out").column_row_linear(x, w, w, 0, RecordingAllReduce(), np.tanh)


# ---- task 2: the cache-aware routing choice ---------------------------------------------------

H1, H2, H3 = b"1" * 32, b"2" * 32, b"3" * 32  # stand-ins for the chained hashes of blocks 1, 1-2, 1-3


@pytest.mark.ch12_cache_aware_routing
@pytest.mark.parametrize("hashes, loads, last_served, max_imbalance, expected", [
    ([H1, H2], [0, 0, 0], {H1: 2}, 4, 2),             # the known prefix's replica
    ([H1, H2], [0, 0, 0], {H1: 2, H2: 1}, 4, 1),      # the longest known prefix wins
    ([H1, H2, H3], [0, 0], {H1: 1, H3: 0}, 4, 0),     # ... even with a gap before it
    ([H1], [5, 1], {H1: 0}, 4, 0),                    # 5 - 1 = 4: not too busy
    ([H1], [6, 1], {H1: 0}, 4, 1),                    # 6 - 1 = 5 > 4: the least loaded
    ([H1], [2, 2, 2], {H1: 1}, 0, 1),                 # all equal: no imbalance at all
    ([H1, H2], [3, 1, 1], {H3: 0}, 4, 1),             # unknown prefix: least loaded, lowest index
    ([], [2, 0], {H1: 0}, 4, 1),                      # no full block: least loaded
])
def test_cache_aware_choice_against_hand_worked_cases(impl, hashes, loads, last_served, max_imbalance, expected):
    choice = impl("ch12_scale_out").cache_aware_choice(hashes, loads, last_served, max_imbalance)
    assert choice == expected


@pytest.mark.ch12_cache_aware_routing
def test_cache_aware_choice_on_real_prompts_sharing_a_system_prompt(impl):
    """The block manager's hashes of two prompts that share 3 blocks: the second goes where the first went."""
    from minillm.serve.router import prefix_hashes

    system = list(range(1000, 1048))          # 3 blocks of 16
    first, second = system + [1] * 20, system + [2] * 20
    last_served = {h: 1 for h in prefix_hashes(first, 16, 8)}
    choose = impl("ch12_scale_out").cache_aware_choice
    assert choose(prefix_hashes(second, 16, 8), [0, 2], last_served, 4) == 1
    assert choose(prefix_hashes(list(range(68)), 16, 8), [0, 2], last_served, 4) == 0  # another prefix


@pytest.mark.ch12_cache_aware_routing
def test_cache_aware_choice_refuses_no_replicas(impl):
    with pytest.raises(ValueError, match="loads"):
        impl("ch12_scale_out").cache_aware_choice([H1], [], {}, 4)
