"""Speculative decoding: tokens/s and accepted length, speculative vs plain, on two workloads.

    .venv/bin/python benchmarks/speculative.py            # the full run (16 + 8 prompts, 96 tokens each)
    .venv/bin/python benchmarks/speculative.py --quick    # a smoke run (2 + 1 prompts, 24 tokens, 1 repeat)

Workloads (chat-templated, greedy):
- *input-grounded*: GROUNDED, summarise / rewrite / edit / refactor requests whose answers copy
  spans of their input - where prompt lookup (n-gram drafting) finds its guesses;
- *open-ended*: OPEN, stories and explanations with nothing to copy - where drafts mostly miss and
  the engine must not get slower (it switches speculation off per sequence when acceptance falls).

Contenders, each in a process of its own (benchmarks/common.py), a fresh one every repeat (so that
whatever slows one process for its whole life weighs on one repeat only), taking turns in an order
that turns each repeat, each timed run right after a short run of its own (main says why): minillm plain, minillm with
``{"method": "ngram", "num_speculative_tokens": K}``, and where ``llama_cpp`` imports, llama.cpp
plain and with its ``LlamaPromptLookupDecoding`` draft model. Each request's rate is its generated
tokens over its wall time (prefill included, alike for all). "Single stream" runs the prompts one
after another; "8 concurrent" (minillm only: llama-cpp-python serves one sequence) gives the
engine all of them at once, 8 at a time. Goal: >= 1.8x single-stream on input-grounded, >= 0.95x
on open-ended. Results: benchmarks/results/speculative.json; with ``--activations int8`` (every
minillm contender in int8 mode, where a verify's k + 1 rows run the T-row integer kernel),
speculative_int8.json.

    .venv/bin/python benchmarks/speculative.py --crossover [--activations int8]

measures where speculation stops paying (``speculation_crossover``), offline, on the per-op path
(the engine's own rule measures its own steps as it runs: runtime/speculative.py's
``paying_draft_length``): for each batch size B, one forward of B decode rows against one
verify forward of B sequences of k + 1 rows. A verify of a sequence yields on average
``tokens_per_verify`` tokens (1 + the mean accepted length; by default the one this file's last
input-grounded single-stream run measured), so drafting pays at B while
verify seconds / plain seconds < tokens_per_verify. Small B is memory-bound (k + 1 rows cost
little more than one), large B compute-bound (they cost k + 1 times as much). Results:
benchmarks/results/speculative_crossover.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from common import (RESULTS, SETTLE_SECONDS, Contender, default_threads, interleaved, ratios, result_name, save_result,
                    start_workers, summarize)

K = 4
SOURCE = Path(__file__).resolve()

PASSAGE = ("The city council met on Tuesday evening to discuss the new public library. After two hours of debate, "
           "the members voted seven to two to approve a budget of four million euros. Construction will begin "
           "in March and the library is expected to open in the autumn of next year.")
CODE = ("def total_price(items, tax_rate):\n    total = 0\n    for item in items:\n        total += item.price * "
        "item.quantity\n    return total * (1 + tax_rate)\n")
GROUNDED = [
    f"Repeat the following text exactly:\n\n{PASSAGE}",
    f"Summarise this text in two sentences, reusing its words:\n\n{PASSAGE}",
    f"Rewrite this text in the past tense:\n\n{PASSAGE}",
    f"Replace 'library' with 'museum' in this text and write the whole text again:\n\n{PASSAGE}",
    f"Rename the function total_price to compute_total and write the whole function again:\n\n{CODE}",
    f"Add a docstring to this function and write the whole function again:\n\n{CODE}",
    f"Rename the variable total to subtotal in this code and write it again:\n\n{CODE}",
    f"Add type hints to this function and write it again:\n\n{CODE}",
    "Fix the spelling and write the corrected sentence: The quick brown foxx jumpd over the lazzy dog near the "
    "river bank on a sunny morning in early spring.",
    "Turn this list into a numbered list, one item per line: apples, oranges, bananas, pears, grapes, lemons, "
    "cherries, plums, peaches, and apricots.",
    "Copy this address exactly: Mr John Smith, 42 Baker Street, Flat 3, London NW1 6XE, United Kingdom.",
    "Write this sentence in uppercase: the meeting is moved from monday morning to thursday afternoon at three.",
    "Quote the first sentence of this text: Water boils at one hundred degrees Celsius at sea level. At higher "
    "altitudes it boils at a lower temperature because the air pressure is lower.",
    "Extract the names from this sentence, as written: Alice Martin, Bob Chen and Carla Rossi met David Okafor "
    "and Emma Schulz in Berlin.",
    "Translate this JSON into YAML: {\"name\": \"minillm\", \"version\": \"0.1\", \"layers\": 30, \"heads\": 9, "
    "\"license\": \"MIT\"}",
    f"Answer using the text: when will construction begin?\n\n{PASSAGE}",
]
OPEN = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me five ideas for a birthday party.",
    "What are the benefits of learning a second language?",
    "Describe a perfect day at the beach.",
    "Write a poem about autumn leaves.",
    "How does a bicycle stay upright?",
    "Tell me about the history of tea.",
]


# Short requests a contender runs right before each timed run (main): none of the workloads' prompts,
# so that llama.cpp's cache of the previous prompt gives a timed run nothing.
WARM_PROMPTS = ["Name a colour.", "Count to three.", "Say hello.", "Name a fruit.", "Name a month.",
                "Say goodbye.", "Name an animal.", "Name a city."]


class Minillm:
    """minillm's engine, plain or speculative; every call runs on a fresh engine."""

    def __init__(self, threads: int, speculative: dict | None = None, activations: str = "fp32"):
        import numba

        import minillm

        numba.set_num_threads(threads)
        self.speculative, self.activations = speculative, activations
        self.llm = minillm.LLM(speculative=speculative, activations=activations)

    def stamp(self) -> dict:
        import numba
        from common import numba_target

        return {"isa": numba_target()["isa"], "numba_threads": numba.get_num_threads(), "speculative": self.speculative,
                "activations": self.activations}

    def prompt_ids(self, prompts: list[str]) -> list[list[int]]:
        return [self.llm.chat_prompt([{"role": "user", "content": p}]) for p in prompts]

    def run(self, prompts: list[str], max_tokens: int, concurrency: int) -> dict:
        """{name: {tokens, seconds, tok_s, drafts, accepted}}: ``concurrency`` requests at a time."""
        from minillm.generation.sampling import SamplingParams
        from minillm.runtime.engine import LLMEngine

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        engine = LLMEngine(self.llm.model, self.llm.tokenizer, max_num_seqs=concurrency, speculative=self.speculative)
        ids = self.prompt_ids(prompts)
        start, tokens = time.perf_counter(), 0
        for first in range(0, len(ids), concurrency):
            requests = [engine.add_request(p, params) for p in ids[first:first + concurrency]]
            while engine.has_unfinished():
                engine.step()
            tokens += sum(len(engine.pop_request(r).outputs[0].token_ids) for r in requests)
        seconds = time.perf_counter() - start
        s = engine.stats()
        return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "drafts": s.spec_decode_num_drafts,
                "draft_tokens": s.spec_decode_num_draft_tokens, "accepted": s.spec_decode_num_accepted_tokens}


class LlamaCpp:
    """llama-cpp-python, plain or with its prompt-lookup draft model, one request at a time."""

    def __init__(self, threads: int, lookup: bool = False):
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        from minillm.model.fetch import cached_model_path, fetch

        self.llama_cpp, self.lookup = llama_cpp, lookup
        draft = LlamaPromptLookupDecoding(num_pred_tokens=K) if lookup else None
        self.llm = llama_cpp.Llama(model_path=str(cached_model_path() or fetch()), n_threads=threads,
                                   n_threads_batch=threads, n_ctx=2048, draft_model=draft, verbose=False)

    def stamp(self) -> dict:
        info = self.llama_cpp.llama_print_system_info().decode()
        isa = "avx512" if "AVX512 = 1" in info else "avx2" if "AVX2 = 1" in info else "other"
        return {"isa": isa, "prompt_lookup": self.lookup, "n_threads": self.llm.n_threads}

    def run(self, prompts: list[str], max_tokens: int, concurrency: int) -> dict:
        if concurrency != 1:
            return {}
        start, tokens = time.perf_counter(), 0
        for p in prompts:
            out = self.llm.create_chat_completion([{"role": "user", "content": p}], max_tokens=max_tokens,
                                                  temperature=0.0)
            tokens += out["usage"]["completion_tokens"]
        seconds = time.perf_counter() - start
        return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def committed_tokens_per_verify(activations: str, default: float = 2.0) -> float:
    """1 + the mean accepted length of the committed input-grounded single-stream ngram run (of ``activations``)."""
    try:
        results = json.loads((RESULTS / f"{result_name('speculative', activations=activations)}.json").read_text())["results"]
        contenders = results["workloads"]["input-grounded"]["concurrency 1"]["contenders"]
        return next(c["mean_accepted_length"] for n, c in contenders.items() if "mean_accepted_length" in c)
    except (OSError, KeyError, StopIteration, ValueError):
        return default


def speculation_crossover(model, k: int = K, tokens_per_verify: float = 2.0,
                          batch_sizes=(1, 2, 3, 4, 6, 8, 12, 16), repeats: int = 7, context: int = 64) -> dict:
    """Per batch size B: the median seconds of a plain decode forward (B rows) and of a verify
    forward (B sequences x (k + 1) rows), interleaved, each sequence ``context`` tokens into a
    contiguous cache -> {"by_batch_size": {B: {...}}, "crossover": the smallest B where
    verify / plain >= tokens_per_verify (None: speculation pays at every B measured)}.
    ``disable_by_batch_size`` = crossover - 1 drafts exactly where it pays (None in the result when
    there is no such setting: no crossover measured, or - ``pays_at_batch_1`` False - none at all)."""
    import numpy as np

    from minillm.model.kv_cache import AttentionMetadata, ContiguousKVCache

    cache = ContiguousKVCache(model.config, n_slots=max(batch_sizes), max_len=context + k + 1)
    by_batch_size, crossover = {}, None
    for B in batch_sizes:
        forwards = {}
        for name, rows in (("plain", 1), ("verify", k + 1)):
            meta = AttentionMetadata(query_lens=[rows] * B, context_lens=[context] * B, seq_slots=list(range(B)))
            forwards[name] = (np.ones(B * rows, dtype=np.int64), meta)
        seconds: dict[str, list[float]] = {"plain": [], "verify": []}
        for _, name in interleaved(["plain", "verify"], repeats + 1):  # the first of each: compile and warm
            ids, meta = forwards[name]
            start = time.perf_counter()
            model.forward(ids, meta, cache)
            seconds[name].append(time.perf_counter() - start)
        plain, verify = (statistics.median(seconds[n][1:]) for n in ("plain", "verify"))
        by_batch_size[B] = {"plain_s": plain, "verify_s": verify, "ratio": verify / plain,
                            "pays": verify / plain < tokens_per_verify}
        if crossover is None and not by_batch_size[B]["pays"]:
            crossover = B
        print(f"B = {B:2d}: plain {plain * 1e3:7.2f} ms, verify {verify * 1e3:7.2f} ms, ratio {verify / plain:5.2f}")
    return {"k": k, "tokens_per_verify": tokens_per_verify, "context": context, "by_batch_size": by_batch_size,
            "crossover": crossover, "pays_at_batch_1": crossover != 1,
            "disable_by_batch_size": crossover - 1 if crossover is not None and crossover > 1 else None}


def crossover_main(args) -> None:
    from minillm.model.loader import load_model

    model = load_model(activations=args.activations)
    tokens = args.tokens_per_verify or committed_tokens_per_verify(args.activations)
    sizes, repeats = ((1, 2), 1) if args.quick else ((1, 2, 3, 4, 6, 8, 12, 16), args.repeats * 3)
    results = speculation_crossover(model, K, tokens, sizes, repeats)
    results["activations"], results["quick"] = args.activations, args.quick
    print("crossover:", results["crossover"], "-> disable_by_batch_size", results["disable_by_batch_size"])
    save_result(result_name("speculative_crossover", activations=args.activations), results)


def contenders(activations: str) -> list[Contender]:
    spec = {"method": "ngram", "num_speculative_tokens": K}
    return [Contender("minillm plain", "Minillm", {"activations": activations}, SOURCE),
            Contender(f"minillm ngram k={K}", "Minillm", {"speculative": spec, "activations": activations}, SOURCE),
            Contender("llama.cpp plain", "LlamaCpp", {}, SOURCE),
            Contender(f"llama.cpp prompt-lookup k={K}", "LlamaCpp", {"lookup": True}, SOURCE)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 + 1 prompts, 24 tokens, 1 repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=default_threads())
    parser.add_argument("--crossover", action="store_true",
                        help="measure the batch size where speculation stops paying (in this process)")
    parser.add_argument("--activations", choices=("fp32", "int8"), default="fp32",
                        help="minillm's activation mode; int8 results go to *_int8.json")
    parser.add_argument("--tokens-per-verify", type=float, default=None,
                        help="--crossover: tokens a verify yields (default: the committed run's 1 + accepted)")
    args = parser.parse_args()
    if args.crossover:
        return crossover_main(args)
    grounded, open_ended = (GROUNDED[:2], OPEN[:1]) if args.quick else (GROUNDED, OPEN)
    max_tokens, repeats = (24, 1) if args.quick else (96, args.repeats)
    cases = [(workload, prompts, concurrency) for workload, prompts in (("input-grounded", grounded),
                                                                         ("open-ended", open_ended))
             for concurrency in (1, 8)]
    # A first set of workers runs every case once, untimed: that compiles every kernel the timed runs
    # meet into Numba's disk cache - each decode batch size as the sequences finish, each verify's
    # rows (a warm-up of a few short requests missed some: first repeats ran at a third to a half of
    # the others' speed).
    workers = start_workers(contenders(args.activations), "native", args.threads)
    try:
        for worker in workers:
            for _, prompts, concurrency in cases:
                worker.call("run", prompts=prompts, max_tokens=max_tokens, concurrency=concurrency)
    finally:
        for worker in workers:
            worker.close()
    # Then fresh processes for every repeat, so that whatever makes one process slower than another
    # for its whole life (where its pages lie, which cores its threads get) weighs on one repeat,
    # not on every repeat of one contender.
    runs: dict[tuple[str, int], dict[str, list]] = {}
    for repeat in range(repeats):
        workers = start_workers(contenders(args.activations), "native", args.threads)
        try:
            for worker in workers:  # the kernels from the disk cache, the process's first touches
                for concurrency in (1, 8):
                    worker.call("run", prompts=GROUNDED[:concurrency], max_tokens=24, concurrency=concurrency)
            for workload, prompts, concurrency in cases:
                # the contenders take turns, the order turning by one each repeat
                for worker in workers[repeat % len(workers):] + workers[:repeat % len(workers)]:
                    time.sleep(SETTLE_SECONDS)  # the previous contender's threads stop spinning
                    # Each timed run right after a short one of its own: on the 2-core VM a run that began
                    # 0.5 s after another minillm contender's ran ~30% faster than one begun after llama.cpp's
                    # or after 3 s idle (open-ended, 8 streams: medians 596 and 458 tok/s, 10 of 12 pairs),
                    # and the fixed order gave that to the n-gram contender; with a short run of its own
                    # first (8 tokens of one request, in that scratch), neither place was faster (4 of 8
                    # pairs either way). It looks like the memory system's state: in one process, the same
                    # case ran at 637 tok/s after 0.5 s idle, 546 after 3 s idle, 473 after 3 s of two
                    # processes spinning on the CPU and 643 after 3 s of two processes summing 256 MB
                    # arrays (medians of 4) - recent memory traffic, anyone's, makes the next run fast.
                    worker.call("run", prompts=WARM_PROMPTS, max_tokens=8, concurrency=concurrency)
                    value, _ = worker.call("run", prompts=prompts, max_tokens=max_tokens, concurrency=concurrency)
                    if value:               # {}: the contender does not run this case
                        runs.setdefault((workload, concurrency), {}).setdefault(worker.name, []).append(value)
        finally:
            for worker in workers:
                worker.close()
    results = {"k": K, "max_tokens": max_tokens, "repeats": repeats, "quick": args.quick,
               "activations": args.activations,
               "protocol": "one untimed pass of every case; then a fresh process per contender and repeat, "
                           "warmed by 2 short runs, the contenders taking turns case by case in an order that "
                           "turns each repeat, each timed run right after 8 tokens of its own on WARM_PROMPTS",
               "workloads": {}}
    for (workload, concurrency), by_name in runs.items():
        entry = {name: {"tok_s": summarize([r["tok_s"] for r in rs]), "runs": rs} for name, rs in by_name.items()}
        for name, rs in by_name.items():
            if sum(r.get("drafts", 0) for r in rs):  # over every repeat: one repeat may draft little
                entry[name]["mean_accepted_length"] = 1 + sum(r["accepted"] for r in rs) / sum(r["drafts"] for r in rs)
        medians = {name: e["tok_s"]["median"] for name, e in entry.items()}
        results["workloads"].setdefault(workload, {})[f"concurrency {concurrency}"] = {
            "contenders": entry, "speedup_vs_minillm_plain": {
                name: medians[name] / medians["minillm plain"] for name in medians},
            "llama_cpp_lookup_vs_plain": ratios(
                {n: m for n, m in medians.items() if n.startswith("llama.cpp")},
                f"llama.cpp prompt-lookup k={K}") if f"llama.cpp prompt-lookup k={K}" in medians else None}
        print(workload, concurrency, {n: round(m, 2) for n, m in medians.items()})
    save_result(result_name("speculative", activations=args.activations), results)


if __name__ == "__main__":
    main()
