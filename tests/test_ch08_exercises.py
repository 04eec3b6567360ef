"""Chapter 08 exercises: the scheduling step, the preemption choice and the batched sampler.

The scheduler runs without a model, as in test_scheduler.py: a simulated model "samples" a token
that is a pure function of the sequence so far (as greedy decoding is), so a sequence that was
preempted and recomputed must end with exactly the tokens it would have produced without
preemption. The sampler is graded on random logits against per-row facts: greedy rows are the
argmax, each row obeys its own filters, seeded rows do not depend on their batch, and a row's
draws follow softmax(logits / T) restricted to its filters.
"""
import random

import numpy as np
import pytest
import torch

from minillm.generation.sampling import SamplingParams, SamplingState
from minillm.runtime.block_manager import BlockManager
from minillm.runtime.sequence import Status
from test_scheduler import make_seq, propose_drafts, unpreempted_output
from test_scheduler import step as schedule_and_update

# -----------------------------------------------------------------------------
# the simulated engine loop


def step(sched):
    """One engine step without a model: schedule, 'compute' (a simulated runner), update -> the plan."""
    plan, _ = schedule_and_update(sched)
    return plan


def run_workload(s, workload, num_blocks, block_size, max_num_seqs, budget, draft_seed=None):
    """workload: (prompt_len, max_tokens, arrival_step) per request. Checks the limits at every step.
    ``draft_seed``: not None, a simulated drafter gives decoding sequences drafts after every step."""
    bm = BlockManager(num_blocks, block_size)
    sched = s.Scheduler(bm, max_num_seqs, budget)
    seqs = [make_seq(i, p, m) for i, (p, m, _) in enumerate(workload)]
    last_arrival = max(a for _, _, a in workload)
    for t in range(10_000):
        for seq, (_, _, arrival) in zip(seqs, workload):
            if arrival == t:
                sched.add(seq)
        if t > last_arrival and not sched.has_unfinished():
            break
        waiting_before = list(sched.waiting)
        plan = step(sched)
        assert plan.num_tokens <= budget, "token budget exceeded"
        assert len(sched.running) <= max_num_seqs, "sequence cap exceeded"
        assert all(x.num_new >= 1 for x in plan.scheduled), "a sequence scheduled with no token to run"
        admitted = [x.seq for x in plan.scheduled if x.seq in waiting_before]
        assert admitted == waiting_before[:len(admitted)], "admission is not first come, first served"
        for x in plan.scheduled:
            if x.samples and x.seq.status is Status.RUNNING:
                assert bm.num_slots(x.seq.seq_id) == x.seq.num_computed_tokens, \
                    "a sequence that sampled must hold slots for its computed tokens only"
        if draft_seed is not None:
            propose_drafts(sched, draft_seed)
    assert all(seq.status is Status.FINISHED for seq in seqs)
    assert bm.num_free_blocks == bm.num_blocks and not bm.seqs, "blocks leaked"
    for seq in seqs:
        assert seq.output_ids == unpreempted_output(seq), f"{seq} differs from its unpreempted output"
    return seqs, sched


def random_workloads(seed, count):
    rng = random.Random(seed)
    for _ in range(count):
        yield [(rng.randint(1, 40), rng.randint(1, 12), rng.randint(0, 6)) for _ in range(rng.randint(1, 10))]


# -----------------------------------------------------------------------------
# task 1: one scheduling step


@pytest.mark.ch08_schedule_step
def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget(impl):
    s = impl("ch08_scheduler")
    sched = s.Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=8)
    seq = make_seq(0, 30, 2)
    sched.add(seq)
    chunks = []
    while seq.num_computed_tokens < 30:
        plan = step(sched)
        chunks.append([(x.seq, x.num_new) for x in plan.scheduled])
    assert chunks == [[(seq, 8)], [(seq, 8)], [(seq, 8)], [(seq, 6)]]
    assert seq.status is Status.RUNNING and sched.running == [seq] and not sched.waiting


@pytest.mark.ch08_schedule_step
def test_running_sequences_decode_first_and_a_new_prompt_takes_the_rest_of_the_budget(impl):
    s = impl("ch08_scheduler")
    sched = s.Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=10)
    a, b, c = make_seq(0, 3, 20), make_seq(1, 5, 20), make_seq(2, 30, 20)
    sched.add(a)
    sched.add(b)
    plan = step(sched)                                            # both prompts fit: 3 + 5 tokens
    assert [(x.seq, x.num_new) for x in plan.scheduled] == [(a, 3), (b, 5)]
    sched.add(c)
    plan = step(sched)
    assert [(x.seq, x.num_new) for x in plan.scheduled] == [(a, 1), (b, 1), (c, 8)]
    plan = step(sched)
    assert [(x.seq, x.num_new) for x in plan.scheduled] == [(a, 1), (b, 1), (c, 8)]
    assert c.num_computed_tokens == 16 and not c.output_ids            # mid-prefill: nothing sampled yet


@pytest.mark.ch08_schedule_step
def test_admission_is_first_come_first_served_under_the_sequence_cap(impl):
    s = impl("ch08_scheduler")
    sched = s.Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [make_seq(i, 4, 3 if i == 0 else 8) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    assert sched.has_unfinished()
    plan = step(sched)
    assert [x.seq for x in plan.scheduled] == seqs[:2] and list(sched.waiting) == seqs[2:]
    step(sched)
    plan = step(sched)                                           # seqs[0] finishes: 3 tokens
    assert seqs[0].status is Status.FINISHED and sched.running == [seqs[1]]
    plan = step(sched)                                           # the freed place goes to the queue's head
    assert [(x.seq, x.num_new) for x in plan.scheduled] == [(seqs[1], 1), (seqs[2], 4)]
    assert list(sched.waiting) == [seqs[3]]


@pytest.mark.ch08_schedule_step
def test_a_prompt_that_does_not_fit_blocks_the_queue(impl):
    s = impl("ch08_scheduler")
    sched = s.Scheduler(BlockManager(4, 4), max_num_seqs=8, max_num_batched_tokens=64)
    first, big, small = make_seq(0, 8, 2), make_seq(1, 12, 2), make_seq(2, 2, 2)
    for seq in (first, big, small):
        sched.add(seq)
    plan = step(sched)                   # first takes 2 blocks; big needs 3 of the 2 left; small must wait too
    assert [x.seq for x in plan.scheduled] == [first] and list(sched.waiting) == [big, small]
    while first.status is not Status.FINISHED:
        step(sched)
    plan = step(sched)                   # first's blocks are back: big, then small behind it
    assert [x.seq for x in plan.scheduled] == [big, small]


@pytest.mark.ch08_schedule_step
def test_a_prompt_found_in_the_prefix_cache_runs_only_its_uncached_tokens(impl):
    s = impl("ch08_scheduler")
    bm = BlockManager(16, 4)
    sched = s.Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    first, again = make_seq(0, 10, 2), make_seq(0, 10, 2)        # equal prompts
    again.seq_id = 1
    sched.add(first)
    step(sched)                                                  # first's full blocks are now cached
    sched.add(again)
    plan = step(sched)
    # The cache covers whole blocks and never the last token: (10 - 1) // 4 * 4 = 8 tokens.
    assert [(x.seq, x.num_new) for x in plan.scheduled] == [(first, 1), (again, 2)]
    assert again.output_ids == first.output_ids[:1]


@pytest.mark.ch08_schedule_step
@pytest.mark.parametrize("seed", range(4))
def test_every_request_finishes_once_with_its_own_tokens(impl, seed):
    s = impl("ch08_scheduler")
    for workload in random_workloads(seed, 10):
        block_size = random.Random(seed).choice([1, 4, 16])
        num_blocks = sum(-(-(p + m) // block_size) for p, m, _ in workload)  # room for all: no preemption
        for max_num_seqs, budget in ((1, 64), (3, 5), (6, 16)):
            seqs, sched = run_workload(s, workload, num_blocks, block_size, max_num_seqs, budget)
            assert sched.num_preemptions == 0


@pytest.mark.ch08_schedule_step
@pytest.mark.parametrize("seed", range(3))
def test_drafts_are_verified_and_the_rejected_ones_give_back_their_slots(impl, seed):
    s = impl("ch08_scheduler")
    for workload in random_workloads(200 + seed, 8):
        block_size = random.Random(seed).choice([1, 4])
        num_blocks = sum(-(-(p + m) // block_size) + 1 for p, m, _ in workload)
        for max_num_seqs, budget in ((4, 64), (3, 5)):
            run_workload(s, workload, num_blocks, block_size, max_num_seqs, budget, draft_seed=seed)


@pytest.mark.ch08_schedule_step
def test_forks_share_the_prompt_and_copy_the_shared_tail_on_write(impl):
    s = impl("ch08_scheduler")
    bm = BlockManager(16, 4)
    sched = s.Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    parent, child = make_seq(0, 6, 3), make_seq(1, 6, 3)
    child.prompt_ids = parent.prompt_ids
    parent.forks = [child]
    sched.add(parent)
    plan = step(sched)                                  # the prompt runs once; both draw from its row
    assert [x.seq for x in plan.scheduled] == [parent] and plan.scheduled[0].forks == [child]
    assert sched.running == [parent, child] and not parent.forks
    assert bm.block_table(child.seq_id) == bm.block_table(parent.seq_id)   # shared: 6 tokens, 2 blocks
    plan = step(sched)                                  # both write position 6 into the shared block 1
    assert [(x.seq, x.num_new) for x in plan.scheduled] == [(parent, 1), (child, 1)]
    assert len(plan.copies) == 1 and plan.copies[0][0] == bm.block_table(child.seq_id)[1]
    while sched.has_unfinished():
        step(sched)
    assert parent.output_ids == child.output_ids == unpreempted_output(parent)
    assert bm.num_free_blocks == bm.num_blocks and not bm.seqs


@pytest.mark.ch08_schedule_step
def test_limits_below_one_are_refused(impl):
    s = impl("ch08_scheduler")
    with pytest.raises(ValueError):
        s.Scheduler(BlockManager(4, 4), max_num_seqs=0)
    with pytest.raises(ValueError):
        s.Scheduler(BlockManager(4, 4), max_num_batched_tokens=0)


# -----------------------------------------------------------------------------
# task 2: preemption


@pytest.mark.ch08_preemption
def test_the_victim_is_the_most_recently_admitted_sequence(impl):
    s = impl("ch08_scheduler")
    running = [make_seq(i, 4, 4) for i in range(3)]
    assert s.choose_victim(running) is running[2]
    assert len(running) == 3, "choosing must not remove anyone"
    running[0].times.arrival = 1e9                     # admission order decides, not arrival time
    assert s.choose_victim(running[:2]) is running[1]
    assert s.choose_victim(running[:1]) is running[0]  # alone: it preempts itself


@pytest.mark.ch08_preemption
def test_preempt_frees_the_blocks_and_requeues_at_the_front(impl):
    s = impl("ch08_scheduler")
    bm = BlockManager(16, 4)
    sched = s.Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64)
    a, b, c = make_seq(0, 6, 8), make_seq(1, 9, 8), make_seq(2, 3, 8)
    for seq in (a, b, c):
        sched.add(seq)
    step(sched)
    step(sched)
    assert b.num_computed_tokens == bm.num_slots(b.seq_id) == 10 and b.num_tokens == 11
    free_before = bm.num_free_blocks
    sched.preempt(b)
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sched.num_preemptions == 1 and sched.running == [a] and list(sched.waiting) == [b, c]
    assert bm.num_free_blocks == free_before + 3 and b.seq_id not in bm.seqs  # 10 slots: 3 blocks of 4
    plan = step(sched)                     # b comes back first, its prompt and output as one prefill...
    # ...of which its two full blocks (8 tokens) are still in the prefix cache
    assert [(x.seq, x.num_new) for x in plan.scheduled] == [(a, 1), (b, 3)]


@pytest.mark.ch08_preemption
def test_out_of_blocks_the_newest_sequence_gives_way_and_no_one_is_admitted(impl):
    s = impl("ch08_scheduler")
    # 3 blocks of 4 tokens for two sequences that each grow to 10 tokens: both cannot fit
    sched = s.Scheduler(BlockManager(3, 4), max_num_seqs=3, max_num_batched_tokens=64)
    a, b, late = make_seq(0, 4, 6), make_seq(1, 4, 6), make_seq(2, 1, 1)
    sched.add(a)
    sched.add(b)
    plans = []
    while sched.has_unfinished():
        plans.append(step(sched))
        if len(plans) == 1:
            sched.add(late)  # waiting when the preemption comes; it would fit in the freed block
    first = next(p for p in plans if p.preempted)
    assert first.preempted == [b] and b not in [x.seq for x in first.scheduled]
    assert all(x.seq is not late for x in first.scheduled), "admitted a request while preempting"
    assert a.num_preemptions == 0 and b.num_preemptions >= 1 and sched.num_preemptions == b.num_preemptions
    assert a.output_ids == unpreempted_output(a) and b.output_ids == unpreempted_output(b)


@pytest.mark.ch08_preemption
@pytest.mark.parametrize("seed", range(4))
def test_under_memory_pressure_every_request_still_gets_its_tokens(impl, seed):
    s = impl("ch08_scheduler")
    preemptions = 0
    for workload in random_workloads(100 + seed, 10):
        block_size = random.Random(seed).choice([1, 4])
        longest = max(p + m for p, m, _ in workload)
        num_blocks = -(-longest // block_size) + seed  # the longest fits alone, little more
        for max_num_seqs, budget in ((4, 64), (6, 7)):
            seqs, sched = run_workload(s, workload, num_blocks, block_size, max_num_seqs, budget)
            preemptions += sched.num_preemptions
    assert preemptions > 0, "the workloads should have forced preemptions"


# -----------------------------------------------------------------------------
# task 3: batched sampling

V = 50


def states_for(*params, prompt_ids=(), output_ids=None):
    return [SamplingState(p, list(prompt_ids), list(output_ids or [])) for p in params]


@pytest.mark.ch08_batched_sampling
def test_greedy_rows_are_the_argmax_with_ties_to_the_lowest_id(impl):
    s = impl("ch08_scheduler")
    logits = np.random.default_rng(0).standard_normal((6, V)).astype(np.float32)  # (B, V)
    logits[2, [7, 30]] = 10.0                                                        # a tie
    result = s.Sampler().sample(logits, states_for(*[SamplingParams(temperature=0)] * 6))
    assert result.token_ids.shape == (6,)
    assert result.token_ids.tolist() == torch.from_numpy(logits).argmax(dim=-1).tolist()
    assert result.token_ids[2] == 7
    assert result.logprobs == [None] * 6


@pytest.mark.ch08_batched_sampling
def test_each_row_obeys_its_own_parameters(impl):
    s = impl("ch08_scheduler")
    rng = np.random.default_rng(1)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1, seed=1),
              SamplingParams(temperature=2.0, top_k=5, seed=2), SamplingParams(temperature=1.0, top_p=0.01, seed=3),
              SamplingParams(temperature=1.5, min_p=1.0, seed=4), SamplingParams(temperature=1.0, seed=5)]
    sampler = s.Sampler()
    for _ in range(20):
        logits = 3 * rng.standard_normal((len(params), V))                          # (B, V)
        tokens = sampler.sample(logits, states_for(*params)).token_ids
        order = np.argsort(-logits, axis=-1)                                         # (B, V) most likely first
        assert tokens[0] == order[0, 0]                                              # greedy
        assert tokens[1] == order[1, 0]                                              # top_k 1: the argmax
        assert tokens[2] in order[2, :5]                                             # top_k 5
        assert tokens[3] == order[3, 0]                                              # tiny top_p: the argmax
        assert tokens[4] == order[4, 0]                                              # min_p 1: only the max
        assert 0 <= tokens[5] < V


@pytest.mark.ch08_batched_sampling
def test_random_rows_follow_the_filtered_softmax(impl):
    s = impl("ch08_scheduler")
    logits = np.random.default_rng(2).standard_normal(V)                             # (V,)
    temperature, k, n = 0.7, 4, 4000
    params = [SamplingParams(temperature=temperature, top_k=k, seed=i) for i in range(n)]
    tokens = s.Sampler().sample(np.tile(logits, (n, 1)), states_for(*params)).token_ids
    expected = torch.zeros(V, dtype=torch.float64)
    top = torch.topk(torch.from_numpy(logits), k)
    expected[top.indices] = torch.softmax(top.values / temperature, dim=0)
    observed = np.bincount(tokens, minlength=V) / n
    assert set(np.flatnonzero(observed)) <= set(top.indices.tolist())
    np.testing.assert_allclose(observed, expected.numpy(), atol=0.03)


@pytest.mark.ch08_batched_sampling
def test_a_seeded_row_does_not_depend_on_its_batch(impl):
    s = impl("ch08_scheduler")
    rng = np.random.default_rng(3)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    others = [SamplingParams(temperature=0), SamplingParams(temperature=0.8), SamplingParams(temperature=1.2, top_k=3)]
    alone, batched = states_for(seeded), states_for(others[0], seeded, *others[1:])
    sampler = s.Sampler()
    for _ in range(10):
        logits = rng.standard_normal((4, V))                                         # (B, V)
        a = sampler.sample(logits[1:2], alone).token_ids[0]
        b = sampler.sample(logits, batched).token_ids[1]
        assert a == b


@pytest.mark.ch08_batched_sampling
def test_min_tokens_holds_back_eos_and_stop_ids(impl):
    s = impl("ch08_scheduler")
    logits = np.zeros((3, V))
    logits[:, 2] = 9.0                      # eos would win
    logits[:, 5] = 8.0                      # a stop id comes second
    logits[:, 11] = 7.0
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5])
    early = SamplingState(params, [], [20])                         # 1 token out: eos and stop ids barred
    done = SamplingState(params, [], [20, 21])                      # 2 out: free to stop
    ignoring = SamplingState(SamplingParams(temperature=0, min_tokens=2, ignore_eos=True), [], [20])
    tokens = s.Sampler(eos_token_ids=[2]).sample(logits, [early, done, ignoring]).token_ids
    assert tokens.tolist() == [11, 2, 2]


@pytest.mark.ch08_batched_sampling
def test_penalties_apply_per_row(impl):
    s = impl("ch08_scheduler")
    logits = np.zeros((3, V))
    logits[:, 4], logits[:, 9] = 2.0, 1.5                           # token 4 leads by 0.5
    plain = SamplingState(SamplingParams(temperature=0), [], [4])
    presence = SamplingState(SamplingParams(temperature=0, presence_penalty=1.0), [], [4])
    repetition = SamplingState(SamplingParams(temperature=0, repetition_penalty=2.0), [4], [])  # 2.0 / 2 < 1.5
    tokens = s.Sampler().sample(logits, [plain, presence, repetition]).token_ids
    assert tokens.tolist() == [4, 9, 9]


@pytest.mark.ch08_batched_sampling
def test_logprobs_are_those_of_the_raw_logits(impl):
    s = impl("ch08_scheduler")
    logits = np.random.default_rng(4).standard_normal((2, V)).astype(np.float32)    # (B, V)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.5, logprobs=None, seed=0)]
    result = s.Sampler().sample(logits, states_for(*params))
    oracle = torch.log_softmax(torch.from_numpy(logits).double(), dim=-1)[0]        # (V,)
    lp, token = result.logprobs[0], int(result.token_ids[0])
    assert lp.token_id == token and lp.rank == 1
    assert lp.logprob == pytest.approx(oracle[token].item(), abs=1e-6)
    top = torch.topk(oracle, 3)
    assert lp.top_ids == top.indices.tolist()
    np.testing.assert_allclose(lp.top_logprobs, top.values.numpy(), atol=1e-6)
    assert result.logprobs[1] is None


@pytest.mark.ch08_batched_sampling
def test_logits_and_states_must_match(impl):
    s = impl("ch08_scheduler")
    with pytest.raises(ValueError):
        s.Sampler().sample(np.zeros((3, V)), states_for(SamplingParams(), SamplingParams()))
    with pytest.raises(ValueError):
        s.Sampler().sample(np.zeros(V), states_for(SamplingParams()))
