"""Which replica serves a request: round robin, least loaded, or cache-aware (**routing**, 路由).

N replicas of the engine each keep their own prefix cache (``runtime/block_manager.py``): a prompt
whose leading blocks some replica computed before skips their prefill *on that replica only*. A
router that spreads requests blindly makes every replica compute every shared system prompt; a
cache-aware one sends a prompt where its prefix most likely still sits, and gives up that
affinity only when the replica is too busy compared with the others.

    policy         decision                                       knows
    RoundRobin     replicas in turn                               nothing
    LeastLoaded    the fewest requests in flight                  the loads
    CacheAware     the replica that last served the longest       the loads and the prompt's
                   prefix of this prompt's blocks, unless it is   leading block hashes
                   busier than the least loaded by > max_imbalance

A replica's *load* is its requests in flight (running + waiting in its engine). Each policy's
``choose(prompt_ids, loads)`` returns the index of a replica; the prefix of a prompt is named by
the block manager's own chained hash (``hash_block``), so "same hash" here means "same cached
blocks" there. Pure Python: no Ray, no I/O - the replica front end (``replicas.py``) calls it.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

from minillm.runtime.block_manager import hash_block

POLICIES = ("round-robin", "least-loaded", "cache-aware")


def least_loaded(loads: Sequence[int]) -> int:
    """The replica with the fewest requests in flight; ties go to the lowest index."""
    if not loads:
        raise ValueError("loads is empty: there is no replica to route to")
    return min(range(len(loads)), key=loads.__getitem__)


def prefix_hashes(prompt_ids: Sequence[int], block_size: int, max_blocks: int) -> list[bytes]:
    """Chained hashes of the prompt's leading full blocks (at most ``max_blocks``), first block first.

    As in the block manager, only blocks that leave the prompt's last token out count: those are
    the ones a replica can have cached (the last token is always computed anew)."""
    hashes, parent = [], None
    for i in range(min((len(prompt_ids) - 1) // block_size, max_blocks)):
        parent = hash_block(prompt_ids[i * block_size:(i + 1) * block_size], parent)
        hashes.append(parent)
    return hashes


def cache_aware_choice(block_hashes: Sequence[bytes], loads: Sequence[int], last_served: Mapping[bytes, int],
                       max_imbalance: int) -> int:
    """The replica for a request whose leading blocks hash to ``block_hashes`` (chained, first first).

    The owner is the replica that last served the longest of these prefixes found in
    ``last_served`` (hash -> replica index): it most likely still holds those blocks. It gets the
    request unless its load exceeds the least-loaded replica's by more than ``max_imbalance``;
    then, and when no prefix is known, the least-loaded replica does."""
    least = least_loaded(loads)
    for block_hash in reversed(block_hashes):  # the longest known prefix wins: it saves the most prefill
        owner = last_served.get(block_hash)
        if owner is not None:
            return owner if loads[owner] - loads[least] <= max_imbalance else least
    return least


class RoundRobin:
    def __init__(self):
        self.next = 0

    def choose(self, prompt_ids: Sequence[int], loads: Sequence[int]) -> int:
        choice = self.next % len(loads)
        self.next = choice + 1
        return choice


class LeastLoaded:
    def choose(self, prompt_ids: Sequence[int], loads: Sequence[int]) -> int:
        return least_loaded(loads)


class CacheAware:
    """``cache_aware_choice`` with its memory: which replica last served each prefix hash.

    The memory is bounded (least recently routed hashes forgotten first), as the replicas' caches
    are: a hash routed long ago has most likely been evicted there too."""

    def __init__(self, block_size: int = 16, max_blocks: int = 32, max_imbalance: int = 4,
                 max_entries: int = 1 << 16):
        if block_size < 1 or max_blocks < 1 or max_entries < 1:
            raise ValueError(f"block_size, max_blocks and max_entries must be >= 1, got {block_size}, "
                             f"{max_blocks}, {max_entries}")
        if max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}")
        self.block_size, self.max_blocks, self.max_imbalance = block_size, max_blocks, max_imbalance
        self.max_entries = max_entries
        self.last_served: OrderedDict[bytes, int] = OrderedDict()

    def choose(self, prompt_ids: Sequence[int], loads: Sequence[int]) -> int:
        hashes = prefix_hashes(prompt_ids, self.block_size, self.max_blocks)
        choice = cache_aware_choice(hashes, loads, self.last_served, self.max_imbalance)
        for block_hash in hashes:  # the chosen replica will hold every one of these blocks
            self.last_served[block_hash] = choice
            self.last_served.move_to_end(block_hash)
        while len(self.last_served) > self.max_entries:
            self.last_served.popitem(last=False)
        return choice


def make_policy(name: str, block_size: int = 16) -> RoundRobin | LeastLoaded | CacheAware:
    """The policy called ``name`` (one of ``POLICIES``); ``block_size``: the replicas' KV block size."""
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "cache-aware":
        return CacheAware(block_size)
    raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {name!r}")
