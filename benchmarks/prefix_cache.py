"""Prefix caching and paged attention: what reusing KV blocks saves, and what paging costs.

    .venv/bin/python benchmarks/prefix_cache.py            # the full run (a minute or two)
    .venv/bin/python benchmarks/prefix_cache.py --quick    # a smoke run (3 repetitions, shorter timings)

Two measurements, each a ratio of two contenders run in one process:

1. TTFT with a shared system prompt (the real model, LLMEngine). A chat request is a system
   prompt of SYSTEM_TOKENS tokens plus a short user turn. *Cold*: a fresh engine, nothing cached,
   the whole prompt is prefilled. *Cached*: an engine that has already served one request with
   the same system prompt - its full blocks are found by hash and only the rest of the prompt
   (the user turn, from the first block that differs) is computed. TTFT is the engine's own
   record, ``seq.times.first_token - seq.times.arrival``; medians over the repetitions, each
   with a different user question. Goal: cached TTFT at least 5x lower.

2. Decode attention at context CONTEXT, kernels only: the paged kernel
   (``paged_attention_decode``, one call for the batch, keys found through shuffled block
   tables) against the contiguous one the chapter 06 cache uses (``attention_decode`` of the
   numba backend, once per sequence, keys in one contiguous row). SmolLM2's head shapes. Goal:
   paged within 1.2x of contiguous.
Results: benchmarks/results/prefix_cache.json.
"""
from __future__ import annotations

import argparse
import statistics

import numba
import numpy as np
from common import save_result, seconds_per_call

from minillm.generation.chat import render_chat
from minillm.generation.sampling import SamplingParams
from minillm.kernels import cpu
from minillm.kernels.cpu.paged_attention import paged_attention_decode
from minillm.llm import load_tokenizer
from minillm.model.fetch import cached_model_path, fetch
from minillm.model.loader import load_model
from minillm.runtime.engine import LLMEngine

SYSTEM_TOKENS = 400
CONTEXT = 1024
BLOCK_SIZE = 16
QUESTIONS = ["When do you open on Sunday?", "Can I order a birthday cake for tomorrow?", "Where can I park?",
             "Do you sell gluten-free bread?", "How much is a croissant?", "Can I pay by card?",
             "Do you deliver?", "What is your best pastry?"]
FACTS = ["The bakery opens at seven and closes at seven, every day except Monday.",
         "It sells bread, croissants, pastries, and cakes to order with two days' notice.",
         "Payment by card or cash; there is no parking, but a tram stop is two minutes away.",
         "Never invent prices or opening hours: say that the shop will confirm them.",
         "Answer politely, in at most three sentences, in the customer's language.",
         "Gluten-free bread is baked on Thursdays only and sells out by noon.",
         "Delivery is possible within the city for orders above thirty euros.",
         "The pastry chef's speciality is the tarte Tatin, baked every morning."]


# -----------------------------------------------------------------------------
# 1. TTFT, cold vs cached

def system_prompt(tokenizer, n_tokens: int) -> str:
    """A system message that tokenizes to about n_tokens tokens: the facts, repeated as rules."""
    lines, i = ["You are the support assistant of a small bakery in Lyon."], 0
    while len(tokenizer.encode(" ".join(lines))) < n_tokens:
        lines.append(f"Rule {i + 1}: {FACTS[i % len(FACTS)]}")
        i += 1
    return " ".join(lines)


def chat_ids(tokenizer, system: str, question: str) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return tokenizer.encode(render_chat(messages, tokenizer.chat_template, add_generation_prompt=True), add_bos=False)


def ttft(engine: LLMEngine, prompt_ids: list[int]) -> float:
    """Seconds from arrival to the first token of one request run alone; max_tokens 1."""
    rid = engine.add_request(prompt_ids, SamplingParams(temperature=0.0, max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    times = engine.pop_request(rid).seqs[0].times
    return times.first_token - times.arrival


def bench_ttft(model, tokenizer, reps: int) -> dict:
    system = system_prompt(tokenizer, SYSTEM_TOKENS)
    prompts = [chat_ids(tokenizer, system, QUESTIONS[i % len(QUESTIONS)]) for i in range(reps + 1)]
    ttft(LLMEngine(model, tokenizer), prompts[0])  # warm-up: compile and fault the weights in
    cold, cached, hits = [], [], []
    for prompt in prompts[1:]:
        cold.append(ttft(LLMEngine(model, tokenizer, block_size=BLOCK_SIZE), prompt))  # an empty cache
    engine = LLMEngine(model, tokenizer, block_size=BLOCK_SIZE)
    ttft(engine, prompts[0])                       # the system prompt's blocks are now cached
    for prompt in prompts[1:]:
        before = engine.block_manager.prefix_cache_hits
        cached.append(ttft(engine, prompt))
        hits.append(engine.block_manager.prefix_cache_hits - before)
    cold_s, cached_s = statistics.median(cold), statistics.median(cached)
    return {"system_prompt_tokens": len(tokenizer.encode(system)),
            "prompt_tokens": [len(p) for p in prompts[1:]], "cached_tokens": hits,
            "cold_ttft_s": cold, "cached_ttft_s": cached,
            "cold_ttft_median_s": cold_s, "cached_ttft_median_s": cached_s, "speedup": cold_s / cached_s}


# -----------------------------------------------------------------------------
# 2. paged vs contiguous decode attention

def bench_attention(batch: int, reps: int, min_sample_s: float, n_heads=9, n_kv_heads=3, head_dim=64) -> dict:
    rng = np.random.default_rng(0)
    blocks_per_seq = CONTEXT // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    q = rng.standard_normal((batch, n_heads, head_dim)).astype(np.float32)                  # (B, H, Dh)
    k_cache = rng.standard_normal((num_blocks, BLOCK_SIZE, n_kv_heads, head_dim)).astype(np.float32)
    v_cache = rng.standard_normal((num_blocks, BLOCK_SIZE, n_kv_heads, head_dim)).astype(np.float32)
    tables = rng.permutation(num_blocks).reshape(batch, blocks_per_seq).astype(np.int32)   # (B, blocks) scattered
    lens = np.full(batch, CONTEXT)                                                          # (B,)
    # the contiguous layout of the same keys: one row of CONTEXT tokens per sequence
    k_rows = k_cache[tables].reshape(batch, CONTEXT, n_kv_heads, head_dim)                  # (B, S, Hkv, Dh)
    v_rows = v_cache[tables].reshape(batch, CONTEXT, n_kv_heads, head_dim)                  # (B, S, Hkv, Dh)

    def paged():
        return paged_attention_decode(q, k_cache, v_cache, tables, lens)                    # (B, H, Dh)

    def contiguous():
        return np.stack([cpu.attention_decode(q[b], k_rows[b], v_rows[b], CONTEXT) for b in range(batch)])

    np.testing.assert_allclose(paged(), contiguous(), rtol=1e-4, atol=1e-5)  # the same attention
    paged_s = statistics.median(seconds_per_call(paged, reps, min_sample_s))
    contiguous_s = statistics.median(seconds_per_call(contiguous, reps, min_sample_s))
    return {"batch": batch, "context": CONTEXT, "block_size": BLOCK_SIZE, "paged_us": paged_s * 1e6,
            "contiguous_us": contiguous_s * 1e6, "paged_over_contiguous": paged_s / contiguous_s}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 repetitions, short timing samples")
    parser.add_argument("--model", default=None, help="a .gguf file or HF directory (default: SmolLM2-135M)")
    args = parser.parse_args()
    reps, min_sample_s = (3, 0.02) if args.quick else (7, 0.2)

    path = args.model or cached_model_path() or fetch()
    model, tokenizer = load_model(path), load_tokenizer(path)
    print(f"threads: numba {numba.get_num_threads()}; medians of {reps} repetitions")

    t = bench_ttft(model, tokenizer, reps)
    print(f"TTFT, {t['system_prompt_tokens']}-token system prompt + user turn ({t['prompt_tokens'][0]} tokens, "
          f"{t['cached_tokens'][0]} found cached): cold {t['cold_ttft_median_s'] * 1e3:.0f} ms, "
          f"cached {t['cached_ttft_median_s'] * 1e3:.0f} ms -> {t['speedup']:.1f}x lower (goal >= 5x)")

    attention = [bench_attention(batch, reps, min_sample_s) for batch in (1, 8)]
    for a in attention:
        print(f"decode attention, batch {a['batch']}, context {CONTEXT}: paged {a['paged_us']:.0f} us, "
              f"contiguous {a['contiguous_us']:.0f} us -> paged/contiguous {a['paged_over_contiguous']:.2f} "
              f"(goal <= 1.2)")
    save_result("prefix_cache", {"quick": args.quick, "model": str(path), "threads": numba.get_num_threads(),
                                 "ttft": t, "decode_attention": attention})


if __name__ == "__main__":
    main()
