"""Where a learner's piece can sit in the engine: the one module attribute the engine calls for
it, swapped for the learner's while generating, and put back afterwards.

Kernels reach the model through the "exercises" kernel backend (course/exercises_backend.py);
everything above the kernels through the swaps below. A task with no seat says why.
"""
from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass

from minillm.course.tasks import all_tasks, chapter_of, is_blank_stub, task

SINGLE, ENGINE, BOTH = "single", "engine", "both"  # generation paths: one request on a contiguous
# cache (chapter 06's Generation), the paged engine (chapters 07-08: LLMEngine), or either


@dataclass(frozen=True)
class Seat:
    targets: tuple[tuple[str, str], ...] = ()  # (module, attribute) the engine calls, set to the learner's
    path: str | None = None                    # SINGLE, ENGINE or BOTH; None: no seat in generation
    note: str = ""                             # why there is no seat, or when the seat is not reached


KERNEL = "kernel: the exercises backend"
SEATS = {
    "ch01_roofline": Seat(note="an analysis function: generation does not call it"),
    "ch01_decode_ceiling": Seat(note="an analysis function: generation does not call it"),
    "ch02_rmsnorm": Seat(path=BOTH, note=KERNEL),
    "ch02_softmax": Seat(note="the model's attention kernels compute their own softmax: no seat"),
    "ch02_rope": Seat(path=BOTH, note=KERNEL),
    "ch02_tiled_matmul": Seat(note="linear layers run on quantized weights (qlinear): no seat"),
    "ch02_decode_attention": Seat(path=SINGLE, note=KERNEL),
    "ch03_vector_add": Seat(note="CUDA kernels: no seat on the CPU path"),
    "ch03_block_reduce": Seat(note="CUDA kernels: no seat on the CPU path"),
    "ch03_tiled_matmul": Seat(note="CUDA kernels: no seat on the CPU path"),
    "ch03_rmsnorm": Seat(note="CUDA kernels: no seat on the CPU path"),
    "ch04_q4_1_dequantize": Seat(path=BOTH, note=KERNEL + " (qlinear for prefill, Q4_1 weights)"),
    "ch04_quant_matvec": Seat(path=BOTH, note=KERNEL + " (qlinear for decode, Q4_1 weights)"),
    "ch04_kv_int8": Seat(note="K/V stay fp32 in the engine; int8 K/V run only in chapter 04's quality measurement: no seat"),
    "ch05_rope_convention": Seat(note="the engine keeps GGUF's row order and rotates adjacent pairs: no seat"),
    "ch05_decoder_layer": Seat((("minillm.model.transformer", "decoder_layer"),), BOTH),
    "ch06_bpe_merge": Seat((("minillm.generation.tokenizer", "bpe_merge"),), BOTH, "encodes the prompt"),
    "ch06_top_p": Seat((("minillm.generation.sampling", "top_p_filter"),), BOTH,
                       "swapped in, but greedy decoding never filters"),
    "ch06_stream_detokenizer": Seat((("minillm.generation.output", "StreamDetokenizer"),), BOTH),
    "ch06_decode_step": Seat((("minillm.generation.generate", "decode_step"),), SINGLE),
    "ch07_block_table": Seat((("minillm.runtime.block_manager", "BlockPool"),), ENGINE),
    "ch07_slot_mapping": Seat((("minillm.runtime.paged_cache", "slot_mapping"),), ENGINE),
    "ch07_block_hash": Seat((("minillm.runtime.block_manager", "hash_block"),), ENGINE),
    "ch07_paged_attention": Seat(path=ENGINE, note=KERNEL),
    "ch08_schedule_step": Seat((("minillm.runtime.engine", "Scheduler"),), ENGINE),
    "ch08_preemption": Seat((("minillm.runtime.scheduler", "choose_victim"),), ENGINE,
                            "reached only when the KV cache runs out"),
    "ch08_batched_sampling": Seat((("minillm.runtime.engine", "Sampler"), ("minillm.generation.generate", "Sampler")),
                                  BOTH),
    "ch09_sse_event": Seat(note="the server's wire format: generation does not call it"),
    "ch09_metric": Seat(note="the load generator's metric: generation does not call it"),
    "ch09_stop_stream": Seat((("minillm.generation.output", "StopStringFilter"),), BOTH),
    "ch10_ngram_drafter": Seat((("minillm.generation.speculative", "ngram_propose"),), ENGINE,
                               "reached only when the engine speculates with method 'ngram'"),
    "ch10_greedy_accept": Seat(note="the engine judges each verified row through the sampler, so penalties and "
                                    "stop checks see every kept token: greedy_accept states the rule, no seat"),
    "ch10_rejection_sampling": Seat(note="the engine's drafters are deterministic (q one-hot): it keeps or redraws "
                                         "row by row with accept_or_resample, not this k-row rule: no seat"),
    "ch10_kv_rollback": Seat((("minillm.runtime.block_manager", "release_tail"),), ENGINE,
                             "reached only when speculation rolls back rejected draft tokens"),
    "ch11_thompson": Seat(note="compiled once per constraint, before generation: no seat"),
    "ch11_subset_construction": Seat(note="compiled once per constraint, before generation: no seat"),
    "ch11_token_mask": Seat(note="built once per constraint and tokenizer: unconstrained generation never masks"),
    "ch12_column_row_linear": Seat(note="a teaching model of the split: the ranks run it on quantized shards "
                                        "(minillm.model.sharding): no seat"),
    "ch12_cache_aware_routing": Seat(note="the router sits in front of the replicas (Ray Serve), not on the "
                                          "generation path: no seat"),
}


def tasks_up_to(chapter: str) -> list[str]:
    """Every task of chapters 01 .. chapter, in order."""
    return [m for m in all_tasks() if chapter_of(m) <= chapter]


def learner_piece(marker: str):
    """The learner's function or class for a seat's task (one per task with a seat)."""
    module, (name,) = task(marker)
    return getattr(module, name)


def written(marker: str) -> bool:
    """The learner has replaced the blank stub (whether it is right is the tests' business)."""
    return not is_blank_stub(learner_piece(marker))


@contextlib.contextmanager
def learner_seats(chapter: str) -> Iterator[list[str]]:
    """Within the block, the engine calls the learner's written pieces of chapters up to `chapter`
    (above the kernels); yields the tasks swapped in. Every attribute is put back on the way out,
    also when the block raises."""
    swapped, originals = [], []
    try:
        for marker in tasks_up_to(chapter):
            seat = SEATS[marker]
            if not seat.targets or not written(marker):
                continue
            for module_name, attr in seat.targets:
                module = importlib.import_module(module_name)
                originals.append((module, attr, getattr(module, attr)))
                setattr(module, attr, learner_piece(marker))
            swapped.append(marker)
        yield swapped
    finally:
        for module, attr, original in reversed(originals):
            setattr(module, attr, original)
