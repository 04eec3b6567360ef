"""The routing policies on made-up replica states, against choices worked out by hand."""
import pytest

from minillm.runtime.block_manager import BlockManager, hash_block
from minillm.serve.router import (CacheAware, LeastLoaded, RoundRobin, cache_aware_choice, least_loaded,
                                  make_policy, prefix_hashes)

A, B, C = b"a" * 32, b"b" * 32, b"c" * 32  # stand-ins for three chained block hashes


def test_round_robin_takes_the_replicas_in_turn_whatever_their_load():
    policy = RoundRobin()
    assert [policy.choose([1, 2, 3], [9, 0, 0]) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_takes_the_fewest_in_flight_and_the_lowest_index_on_ties():
    assert least_loaded([3, 1, 2]) == 1
    assert least_loaded([2, 0, 0]) == 1
    assert LeastLoaded().choose([5], [4, 4, 4]) == 0
    with pytest.raises(ValueError, match="loads is empty"):
        least_loaded([])


def test_prefix_hashes_are_the_block_managers_chained_hashes_of_the_full_blocks_before_the_last_token():
    prompt = list(range(100, 137))  # 37 tokens, block size 16: blocks 0..15 and 16..31 are full
    first = hash_block(prompt[:16], None)
    assert prefix_hashes(prompt, 16, max_blocks=8) == [first, hash_block(prompt[16:32], first)]
    assert prefix_hashes(prompt, 16, max_blocks=1) == [first]
    assert prefix_hashes(prompt[:17], 16, 8) == [first]   # 16 tokens before the last one: one block
    assert prefix_hashes(prompt[:16], 16, 8) == []        # the last token is never cached: no full block


def test_prefix_hashes_name_what_the_block_manager_caches():
    """The oracle is the block manager itself: after a prompt's blocks are computed, another prompt
    sharing its first block finds exactly the blocks whose hashes the router computed for it."""
    bm = BlockManager(num_blocks=16, block_size=4)
    first = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    bm.allocate("first", first)
    bm.mark_computed("first", first, len(first))
    second = [1, 2, 3, 4, 0, 0, 0, 0, 9]  # shares the first block only
    shared = set(prefix_hashes(first, 4, 8)) & set(prefix_hashes(second, 4, 8))
    assert bm.allocate("second", second) == 4 * len(shared)  # the cached tokens: the shared hashes' blocks
    assert bm.block_table("second")[0] == bm.block_table("first")[0]
    assert shared == {hash_block(first[:4], None)}


def test_cache_aware_sends_a_known_prefix_to_the_replica_that_last_served_it():
    assert cache_aware_choice([A, B], loads=[0, 3, 0], last_served={A: 2, B: 1}, max_imbalance=4) == 1  # B is longer
    assert cache_aware_choice([A, B], loads=[0, 3, 0], last_served={A: 2}, max_imbalance=4) == 2
    assert cache_aware_choice([A, B, C], loads=[1, 0], last_served={A: 0}, max_imbalance=1) == 0


def test_cache_aware_falls_back_to_the_least_loaded_when_the_owner_is_too_busy():
    assert cache_aware_choice([A], loads=[5, 1], last_served={A: 0}, max_imbalance=4) == 0   # 5 - 1 = 4: still ok
    assert cache_aware_choice([A], loads=[6, 1], last_served={A: 0}, max_imbalance=4) == 1   # 6 - 1 = 5 > 4
    assert cache_aware_choice([A], loads=[1, 0, 3], last_served={A: 2}, max_imbalance=0) == 1


def test_cache_aware_sends_an_unknown_or_blockless_prompt_to_the_least_loaded():
    assert cache_aware_choice([A, B], loads=[2, 1, 1], last_served={C: 0}, max_imbalance=4) == 1
    assert cache_aware_choice([], loads=[2, 0], last_served={A: 0}, max_imbalance=4) == 1


def test_the_cache_aware_policy_remembers_where_each_prefix_went():
    policy = CacheAware(block_size=4, max_imbalance=1)
    system = [7] * 8                     # two full blocks shared by every prompt
    one, two = system + [1, 1, 1, 1, 1], system + [2, 2, 2, 2, 2]
    assert policy.choose(one, [1, 0]) == 1  # nothing known yet: the least loaded
    assert policy.choose(two, [0, 1]) == 1  # the system prompt's blocks went to 1: 1 - 0 <= 1
    assert policy.choose(one, [0, 2]) == 0  # 2 - 0 > 1: too busy, and now 0 served them last
    assert policy.choose(two, [1, 1]) == 1  # its own third block still points at 1: the longest prefix wins
    assert policy.choose(system + [3] * 5, [1, 1]) == 1  # a new user turn: the system prompt last went to 1
    assert policy.choose([3] * 9, [1, 0]) == 1  # another prefix


def test_the_cache_aware_memory_forgets_the_least_recently_routed_hashes_first():
    policy = CacheAware(block_size=2, max_blocks=1, max_entries=2)
    for prompt in ([1, 1, 0], [2, 2, 0], [1, 1, 0], [3, 3, 0]):  # [1, 1] routed again before [3, 3] arrives
        policy.choose(prompt, [0, 0])
    assert list(policy.last_served) == [hash_block([1, 1], None), hash_block([3, 3], None)]


def test_bad_policy_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="routing must be one of round-robin, least-loaded, cache-aware"):
        make_policy("random")
    with pytest.raises(ValueError, match="max_imbalance"):
        CacheAware(max_imbalance=-1)
    with pytest.raises(ValueError, match="block_size"):
        CacheAware(block_size=0)
    assert isinstance(make_policy("cache-aware", block_size=32), CacheAware)
    assert make_policy("cache-aware", block_size=32).block_size == 32
