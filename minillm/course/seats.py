"""Where a learner's piece sits in the engine, and how ``your_code`` reaches it.

Kinds of seat (``Seat.kind``):
- KERNEL: the op the forward calls, through the learner's backend (the "exercises" kernel backend,
  course/exercises_backend.py, composed into the forward by course/learner_ops.py);
- SWAP: the one module attribute the engine calls for it, set to the learner's while generating
  and put back afterwards (``learner_seats``);
- CALL: your_code calls it itself - chapter 01's roofline and decode ceiling make the prediction
  it compares with the measured decode speed;
- CUDA: chapter 03's kernels run a tiny model's forward in a process of its own, on the CUDA
  simulator when there is no GPU (minillm/course/cuda_seat.py);
- HOOK: no seat yet - the note names the hook in the engine or server it needs.
``path`` says which of your_code's runs reaches it: one request on a contiguous KV cache
(chapter 06's Generation; greedy on fp32 K/V, and a seeded sampled one on int8 K/V), or the paged
engine (chapters 07-08, LLMEngine, with a KV budget small enough to preempt), or the server (from
chapter 09: one streamed completion through the OpenAI app in process, then /metrics; it runs
the paged engine too, so BOTH's seats are reached there as well).
ROUTER: chapter 12's routing run - the replica set's routing policy on a shared-prefix workload.
TENSOR_PARALLEL: chapter 12's tensor-parallel run - the greedy request on 2 ranks, spawned processes
that each import and count the learner's piece themselves (course/tensor_parallel_seat.py).
"""
from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass

from minillm.course.tasks import all_tasks, chapter_of, is_blank_stub, task

SINGLE, ENGINE, BOTH, SERVER = "single", "engine", "both", "server"  # which run reaches a seat (see the docstring)
ROUTER = "router"  # chapter 12's routing run
TENSOR_PARALLEL = "tensor-parallel"  # chapter 12's tensor-parallel run
KERNEL, SWAP, CALL, CUDA, HOOK = "kernel", "swap", "call", "cuda", "hook"


@dataclass(frozen=True)
class Seat:
    kind: str
    targets: tuple[tuple[str, str], ...] = ()  # SWAP: (module, attribute) the engine calls, set to the learner's
    path: str | None = None                    # SINGLE, ENGINE, BOTH, SERVER, ROUTER or TENSOR_PARALLEL;
    #                                            None for CALL, CUDA and HOOK
    note: str = ""                             # what reaches it, or the hook it needs


def swap(*targets: tuple[str, str], path: str = BOTH, note: str = "") -> Seat:
    return Seat(SWAP, targets, path, note)


SEATS = {
    "ch01_roofline": Seat(CALL, note="the attainable FLOP/s of a decode step: the prediction beside the measured run"),
    "ch01_decode_ceiling": Seat(CALL, note="the decode ceiling: the prediction beside the measured run"),
    "ch02_rmsnorm": Seat(KERNEL, path=BOTH, note="ops.rms_norm"),
    "ch02_softmax": Seat(KERNEL, path=BOTH, note="inside attention (reference attention on your softmax)"),
    "ch02_rope": Seat(KERNEL, path=BOTH, note="ops.rope"),
    "ch02_tiled_matmul": Seat(KERNEL, path=BOTH, note="prefill's linear layers: x @ dequantize(W).T"),
    "ch02_decode_attention": Seat(KERNEL, path=SINGLE, note="ops.attention_decode (contiguous cache)"),
    "ch03_vector_add": Seat(CUDA, note="the residual adds of a tiny model's forward"),
    "ch03_block_reduce": Seat(CUDA, note="attention's softmax denominators in a tiny model's forward"),
    "ch03_tiled_matmul": Seat(CUDA, note="the linear layers of a tiny model's forward"),
    "ch03_rmsnorm": Seat(CUDA, note="the RMSNorms of a tiny model's forward"),
    "ch04_q4_1_dequantize": Seat(KERNEL, path=BOTH, note="prefill's Q4_1 linear layers"),
    "ch04_quant_matvec": Seat(KERNEL, path=BOTH, note="decode's Q4_1 linear layers"),
    "ch04_kv_int8": swap(("minillm.model.quality", "quantize_kv_int8"), ("minillm.model.quality", "dequantize_kv_int8"),
                         path=SINGLE, note="the int8 KV cache of the sampled request"),
    "ch05_rope_convention": swap(("minillm.model.loader", "unpermute_qk_rows"),
                                 note="Q/K rows in Hugging Face order, rotated by halves"),
    "ch05_decoder_layer": swap(("minillm.model.transformer", "decoder_layer")),
    "ch06_bpe_merge": swap(("minillm.generation.tokenizer", "bpe_merge"), note="encodes the prompt"),
    "ch06_top_p": swap(("minillm.generation.sampling", "top_p_filter"), note="the seeded sampled request"),
    "ch06_stream_detokenizer": swap(("minillm.generation.output", "StreamDetokenizer")),
    "ch06_decode_step": swap(("minillm.generation.generate", "decode_step"), path=SINGLE),
    "ch07_block_table": swap(("minillm.runtime.block_manager", "BlockPool"), path=ENGINE),
    "ch07_slot_mapping": swap(("minillm.runtime.paged_cache", "slot_mapping"), path=ENGINE),
    "ch07_block_hash": swap(("minillm.runtime.block_manager", "hash_block"), path=ENGINE),
    "ch07_paged_attention": Seat(KERNEL, path=ENGINE, note="ops.paged_attention_decode"),
    "ch08_schedule_step": swap(("minillm.runtime.engine", "Scheduler"), path=ENGINE),
    "ch08_preemption": swap(("minillm.runtime.scheduler", "choose_victim"), path=ENGINE,
                            note="the engine run's KV budget is too small for all its requests at once"),
    "ch08_batched_sampling": swap(("minillm.runtime.engine", "Sampler"), ("minillm.generation.generate", "Sampler")),
    "ch09_sse_event": swap(("minillm.serve.routes", "sse_event"), path=SERVER,
                           note="every event of the server's streamed completions"),
    "ch09_metric": swap(("minillm.serve.metrics", "request_latencies"), path=SERVER,
                        note="TTFT, ITL, TPOT and E2E of each finished request, in /metrics"),
    "ch09_stop_stream": swap(("minillm.generation.output", "StopStringFilter")),
    "ch10_ngram_drafter": swap(("minillm.generation.speculative", "ngram_propose"), path=ENGINE,
                               note="the speculative engine run (method 'ngram')"),
    "ch10_greedy_accept": swap(("minillm.generation.speculative", "greedy_accept"), path=ENGINE,
                               note="judges the draft rows of the greedy speculative run (verify_draft)"),
    "ch10_rejection_sampling": swap(("minillm.generation.speculative", "rejection_sample"), path=ENGINE,
                                    note="judges the draft rows of the sampled speculative run (verify_draft; "
                                         "top_k 1: every correct rule keeps the same tokens)"),
    "ch10_kv_rollback": swap(("minillm.runtime.block_manager", "release_tail"), path=ENGINE,
                             note="the speculative engine run rolls back rejected draft tokens"),
    "ch11_thompson": swap(("minillm.generation.constrained.automata", "thompson"), path=ENGINE,
                          note="the NFA of the constrained run's guided_regex (byte_dfa)"),
    "ch11_subset_construction": swap(("minillm.generation.constrained.automata", "determinize"), path=ENGINE,
                                     note="the DFA of the constrained run's guided_regex (byte_dfa)"),
    "ch11_token_mask": swap(("minillm.generation.constrained.token_index", "allowed_tokens"), path=ENGINE,
                            note="the constrained run's token index, asked state by state"),
    "ch12_column_row_linear": swap(("minillm.model.sharding", "column_row_linear"), path=TENSOR_PARALLEL,
                                   note="the SwiGLU block of each of 2 tensor-parallel ranks, on its own shard "
                                        "(world_size 1 in each process; its all_reduce is the group's)"),
    "ch12_cache_aware_routing": swap(("minillm.serve.router", "cache_aware_choice"), path=ROUTER,
                                     note="the replica set's cache-aware policy (make_policy, as ReplicaSet "
                                          "builds it) routes chapter 12's shared-prefix workload, without Ray"),
}


def tasks_up_to(chapter: str) -> list[str]:
    """Every task of chapters 01 .. chapter, in order."""
    return [m for m in all_tasks() if chapter_of(m) <= chapter]


def learner_pieces(marker: str) -> dict[str, object]:
    """The learner's functions (or classes) a task grades, by name."""
    module, names = task(marker)
    return {name: getattr(module, name) for name in names}


def written(marker: str) -> bool:
    """The learner has replaced every blank stub of the task (whether it is right is the tests' business)."""
    return not any(is_blank_stub(piece) for piece in learner_pieces(marker).values())


def seat_targets(marker: str) -> list[tuple[str, str, str]]:
    """(module, attribute, the learner's name it gets) per target of a SWAP seat: a task of one
    function puts it at every target; a task of several puts its i-th at the i-th target."""
    seat, (_, names) = SEATS[marker], task(marker)
    return [(module, attr, names[0] if len(names) == 1 else names[i]) for i, (module, attr) in enumerate(seat.targets)]


@contextlib.contextmanager
def learner_seats(chapter: str, reach=None) -> Iterator[list[str]]:
    """Within the block, the engine calls the learner's written pieces of chapters up to `chapter`
    (SWAP seats); yields the tasks swapped in. With ``reach`` (a learner_ops.Reach), each piece is
    counted - at its seat and in the learner's own module, so that the learner's code calling its
    own piece counts too. Every attribute is put back on the way out, also when the block raises."""
    swapped, originals = [], []

    def put(module, attr, value):
        originals.append((module, attr, getattr(module, attr)))
        setattr(module, attr, value)

    try:
        for marker in tasks_up_to(chapter):
            if SEATS[marker].kind != SWAP or not written(marker):
                continue
            pieces = learner_pieces(marker)
            if reach is not None:
                learner_module, _ = task(marker)
                for name, piece in list(pieces.items()):
                    pieces[name] = reach.wrap(marker, piece)
                    if not hasattr(piece, "py_func"):  # a Numba kernel keeps its own name: its callers are compiled
                        put(learner_module, name, pieces[name])
            for module_name, attr, name in seat_targets(marker):
                put(importlib.import_module(module_name), attr, pieces[name])
            swapped.append(marker)
        yield swapped
    finally:
        for module, attr, original in reversed(originals):
            setattr(module, attr, original)
