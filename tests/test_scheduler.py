"""Scheduler invariants under random arrival workloads, with a simulated model (no forward).

The simulated model "samples" a token that is a pure function of the sequence so far, as greedy
decoding is, so a preempted-and-recomputed sequence must end with exactly the tokens it would
have produced without preemption.
"""
import hashlib
from types import SimpleNamespace

from hypothesis import given, settings, strategies as st

from minillm.generation.sampling import SamplingParams
from minillm.runtime.block_manager import BlockManager
from minillm.runtime.scheduler import RunnerOutput, Scheduler
from minillm.runtime.sequence import Sequence, Status

VOCAB = 1000


def next_token(token_ids):
    return int.from_bytes(hashlib.sha256(str(token_ids).encode()).digest()[:4], "little") % VOCAB


def make_seq(i, prompt_len, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    prompt = [(i * 31 + j) % VOCAB for j in range(prompt_len)]
    return Sequence(i, str(i), prompt, params)


def emit(seq, token, logprobs):
    """The engine's part, simulated: a sequence ends at max_tokens (no eos here)."""
    return SimpleNamespace(seq=seq, token=token, finished=len(seq.output_ids) == seq.params.max_tokens)


def simulated_output(plan):
    """The runner, simulated: each sampling sequence (and each fork) draws the simulated model's token;
    a draft is kept while it equals what the model would have drawn, then the model's own token."""
    token_ids = {}
    for s in plan.scheduled:
        if not s.samples:
            continue
        for member in (s.seq, *s.forks):
            tokens, context = [], list(member.token_ids)
            for guess in s.draft + [None]:
                tokens.append(next_token(context + tokens))
                if tokens[-1] != guess:
                    break
            token_ids[member.seq_id] = tokens
    return RunnerOutput(token_ids)


def step(sched):
    """One engine step without a model -> (plan, what emit returned for each token)."""
    plan = sched.schedule()
    return plan, sched.update_from_output(plan, simulated_output(plan), emit)


def propose_drafts(sched, rng_seed):
    """A simulated drafter: up to 3 guesses for each decoding sequence, right for a while, then wrong."""
    for seq in sched.running:
        room = seq.params.max_tokens - len(seq.output_ids) - 1
        if seq.num_uncomputed != 1 or not seq.output_ids or room < 1:
            continue
        k, right = min(3, room), next_token([rng_seed, *seq.token_ids]) % 4
        draft = []
        for j in range(k):
            truth = next_token(seq.token_ids + draft)
            draft.append(truth if j < right else (truth + 1) % VOCAB)
        seq.draft_ids = draft


def run(workload, num_blocks, block_size, max_num_seqs, budget, draft_seed=None):
    """Drive the scheduler step by step; arrivals join at their step. Returns sequences and a log.
    ``draft_seed``: not None, a simulated drafter proposes after every step."""
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(bm, max_num_seqs, budget)
    seqs = [make_seq(i, p, m) for i, (p, m, _) in enumerate(workload)]
    arrivals = sorted(range(len(seqs)), key=lambda i: (workload[i][2], i))
    finished_count, step = {}, 0
    while step < 10_000:
        for i in arrivals:
            if workload[i][2] == step:
                sched.add(seqs[i])
        if not sched.has_unfinished() and all(workload[i][2] <= step for i in arrivals):
            break
        waiting_before = list(sched.waiting)
        plan = sched.schedule()
        assert plan.num_tokens <= budget, "token budget exceeded"
        assert len(sched.running) <= max_num_seqs, "sequence cap exceeded"
        # FCFS: sequences leave the waiting queue from its head, in order (preempted ones rejoin at the head)
        admitted = [s.seq for s in plan.scheduled if s.seq in waiting_before]
        assert admitted == waiting_before[: len(admitted)]
        assert all(s.num_new >= 1 for s in plan.scheduled)
        for out in sched.update_from_output(plan, simulated_output(plan), emit):
            if out.finished:
                finished_count[out.seq.seq_id] = finished_count.get(out.seq.seq_id, 0) + 1
        for s in plan.scheduled:   # a sequence that sampled holds slots for its computed tokens only
            if s.samples and not s.seq.finished:
                assert bm.num_slots(s.seq.seq_id) == s.seq.num_computed_tokens == s.seq.num_tokens - 1
        if draft_seed is not None:
            propose_drafts(sched, draft_seed)
        step += 1
    return seqs, bm, sched, finished_count


def unpreempted_output(seq):
    ids = list(seq.prompt_ids)
    for _ in range(seq.params.max_tokens):
        ids.append(next_token(ids))
    return ids[len(seq.prompt_ids):]


workloads = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 6)), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(workload=workloads, block_size=st.sampled_from([1, 4, 16]), max_num_seqs=st.integers(1, 6),
       budget=st.integers(1, 64), spare_blocks=st.integers(0, 8),
       draft_seed=st.none() | st.integers(0, 1000))
def test_scheduler_invariants(workload, block_size, max_num_seqs, budget, spare_blocks, draft_seed):
    longest = max(p + m for p, m, _ in workload)
    num_blocks = -(-longest // block_size) + spare_blocks  # the longest sequence always fits alone
    seqs, bm, sched, finished_count = run(workload, num_blocks, block_size, max_num_seqs, budget, draft_seed)
    assert all(s.status is Status.FINISHED for s in seqs)
    assert finished_count == {s.seq_id: 1 for s in seqs}, "every request finishes exactly once"
    assert bm.num_free_blocks == bm.num_blocks and not bm.seqs, "blocks leaked"
    for s in seqs:
        assert s.output_ids == unpreempted_output(s), f"{s} differs from its unpreempted output"


def test_preemption_happens_and_frees_the_newest_sequence():
    # two sequences that cannot both grow: 3 blocks of 4 tokens
    seqs, bm, sched, _ = run([(4, 6, 0), (4, 6, 0)], num_blocks=3, block_size=4, max_num_seqs=2, budget=64)
    assert sched.num_preemptions >= 1
    assert seqs[1].num_preemptions >= 1 and seqs[0].num_preemptions == 0
    assert all(s.output_ids == unpreempted_output(s) for s in seqs)


def test_chunked_prefill_splits_a_long_prompt_under_the_budget():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8)
    seq = make_seq(0, 30, 2)
    sched.add(seq)
    chunks = []
    while seq.num_computed_tokens < 30:
        plan, _ = step(sched)
        chunks.append(plan.scheduled[0].num_new)
    assert chunks == [8, 8, 8, 6]


def test_abort_in_every_state_frees_blocks():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=4)
    running, mid_prefill, waiting = make_seq(0, 3, 5), make_seq(1, 10, 5), make_seq(2, 3, 5)
    sched.add(running)
    step(sched)
    assert running.output_ids
    sched.finish(running)  # abort while running (decoding)
    sched.add(mid_prefill)
    sched.add(waiting)
    step(sched)
    assert mid_prefill.num_computed_tokens == 4 < 10
    sched.finish(mid_prefill)  # abort mid-prefill
    sched.finish(waiting)      # abort while waiting (never admitted)
    assert bm.num_free_blocks == bm.num_blocks and not sched.has_unfinished()


def test_a_short_request_finishes_within_a_bounded_number_of_steps_while_two_full_contexts_run():
    """The fairness rule of the Scheduler docstring: decode tokens first, and a share of the token
    budget left for admissions while sequences wait."""
    context, budget, max_tokens = 1024, 64, 4
    bm = BlockManager(3 * context // 16, 16)             # room for both long ones and the short one
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=budget)
    long_ones = [make_seq(0, context - 8, 8), make_seq(1, context - 8, 8)]
    for seq in long_ones:
        sched.add(seq)
    for _ in range(3):                                   # the long prefills are under way
        step(sched)
    short = make_seq(2, 4, max_tokens)
    sched.add(short)
    steps = 0
    while short.status is not Status.FINISHED:
        step(sched)
        steps += 1
        assert steps <= max_tokens + 1, "the short request waited behind the long prefills"
    assert not any(seq.output_ids for seq in long_ones)  # the long ones were still prefilling all along
