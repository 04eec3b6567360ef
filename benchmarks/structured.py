"""Structured output: what the token mask costs per token, what compiling a schema costs, what
jump-forward saves, and llama.cpp's grammar-constrained generation on the same schemas.

    .venv/bin/python benchmarks/structured.py             # about 3-4 minutes on 2 busy cores
    .venv/bin/python benchmarks/structured.py --turns 1   # a smoke run
    .venv/bin/python benchmarks/structured.py --threads 1 # a machine whose cores other jobs share: Numba's
                                                          # parallel loops stall when the cores are oversubscribed

The schemas are chapter 11's (``minillm.generation.constrained.examples``): a person, a weather
tool call, and a product with ten properties of every supported kind. Each contender runs in a
process of its own (``common.Worker``) on the same GGUF file and thread count, and they take
turns; every figure is the median over the turns.

minillm:
1. **index build** per schema, caches cleared: JSON Schema -> regex -> byte DFA (``compile_s``),
   then the token index over the 49152-token vocabulary (``index_s``). The vocabulary trie is
   built once per tokenizer and reported on its own. Goal: under 1 s for the ten-property schema.
2. **mask overhead per token**, batch 1 and 16: the work a constrained sequence adds to a step -
   the sampler with the mask (greedy: the argmax over the allowed ids) instead of without, the
   DFA advance, and jump-forward's look for forced text - divided by the time of a decode step of
   the same batch. The states are the ones a real greedy generation of every schema visits, the
   rows of a batch spread over them. Goal: under 10% of a decode step.
3. **jump-forward**: greedy generation of each schema with it and without it - tokens per model
   forward (``LLMEngine.observe`` counts the steps), and seconds per request.
4. **validity**: every greedy output must parse and validate against its schema (``jsonschema``).

``--coverage`` (issue 30): the schemas under benchmarks/data/schemas/ (public, see its README),
each engine asked to accept each one (compile it into its constraint) within 20 s, each attempt in
a process of its own; for minillm then a greedy answer with max_tokens 512 (budget-aware closing
included: valid even when cut) and the per-token mask time of that answer at batch 1 (median,
GrammarGuide.allowed from a cold index, so first-visit walks count). llama.cpp's
``LlamaGrammar.from_json_schema`` runs beside it only where llama-cpp-python is installed.

    .venv/bin/python benchmarks/structured.py --coverage                 # every shipped schema
    .venv/bin/python benchmarks/structured.py --coverage --schemas lerna  # a smoke run

llama.cpp (``llama-cpp-python``): ``LlamaGrammar.from_json_schema`` per schema (its build time),
then ``create_completion`` on the same prompt token ids, greedy, with the grammar: seconds, tokens,
validity; beside it, its unconstrained decode time per token (one ``eval`` per token).
Results: benchmarks/results/structured.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import jsonschema
import numpy as np
from common import (BENCHMARKS, RESULTS, SETTLE_SECONDS, Contender, ContenderUnavailable, Worker, default_threads,
                    interleaved, save_result, summarize, timed)
from contenders import LlamaCpp, Minillm

from minillm.generation.constrained.examples import PROMPTS, SCHEMAS

MAX_TOKENS = 256         # enough for every schema's greedy answer: a cut one would not parse
BATCHES = (1, 16)
DECODE_STEPS = 24        # timed decode steps at each batch size
MASK_OVERHEAD_GOAL, INDEX_BUILD_GOAL_S = 0.10, 1.0


def validate(text: str, schema: dict) -> str | None:
    """None if `text` parses and validates against `schema`, else what is wrong."""
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError) as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return None


# -----------------------------------------------------------------------------------------------
# The contenders (built inside their worker process)


class MinillmStructured(Minillm):
    """minillm's compiler, token index, masked sampler and jump-forward (chapter 11)."""

    def prompts(self) -> dict[str, list[int]]:
        """Each schema's chat prompt as token ids: both contenders get exactly these."""
        return {name: self.llm.chat_prompt([{"role": "user", "content": PROMPTS[name]}]) for name in SCHEMAS}

    def vocabulary_trie(self) -> float:
        from minillm.generation.constrained.token_index import vocabulary_trie

        vocabulary_trie.cache_clear()
        start = time.perf_counter()
        vocabulary_trie(self.llm.tokenizer)
        return time.perf_counter() - start

    def build_index(self, name: str) -> dict:
        """One schema compiled from nothing (the trie aside): regex, byte DFA, token index."""
        from minillm.generation.constrained.automata import compile_byte_dfa
        from minillm.generation.constrained.json_schema import schema_to_regex
        from minillm.generation.constrained.token_index import TokenIndex, token_index

        compile_byte_dfa.cache_clear()
        token_index.cache_clear()
        start = time.perf_counter()
        pattern = schema_to_regex(SCHEMAS[name])
        dfa = compile_byte_dfa(pattern)
        compiled = time.perf_counter()
        index = TokenIndex(dfa, self.llm.tokenizer)
        done = time.perf_counter()
        return {"regex_chars": len(pattern), "dfa_states": dfa.num_states,
                "allowed_entries": int(index.offsets[-1]), "compile_s": compiled - start, "index_s": done - compiled}

    def generate(self, name: str, jump_forward: bool) -> dict:
        """One greedy constrained request: its text, tokens, model forwards and seconds."""
        from minillm.generation.constrained import schema_to_regex, token_index
        from minillm.generation.sampling import SamplingParams

        token_index(schema_to_regex(SCHEMAS[name]), self.llm.tokenizer)   # built before the clock starts
        engine = self.llm.engine
        engine.jump_forward = jump_forward
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, guided_json=SCHEMAS[name])
        forwards = []
        stop = engine.observe(lambda plan, outputs: forwards.append(1))
        try:
            start = time.perf_counter()
            out = self.llm.generate([self.prompts()[name]], params, use_tqdm=False)[0]
            seconds = time.perf_counter() - start
        finally:
            stop()
            engine.jump_forward = True
        return {"text": out.text, "token_ids": out.token_ids, "tokens": len(out.token_ids), "forwards": len(forwards),
                "finish_reason": out.finish_reason, "seconds": seconds}

    def decode_step(self, batch: int) -> float:
        """Median seconds of a decode step with `batch` unconstrained sequences."""
        from minillm.generation.sampling import SamplingParams

        engine, rng = self.llm.engine, np.random.default_rng(batch)
        params = SamplingParams(temperature=0, max_tokens=DECODE_STEPS + 2, ignore_eos=True)
        ids = [engine.add_request(rng.integers(17, 10_000, 32).tolist(), params) for _ in range(batch)]
        times = []
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        for i in ids:
            engine.pop_request(i)
        return statistics.median(times[2:])   # the first step prefills every prompt

    def _visited(self) -> list:
        """(token index, DFA state) of every step of every schema's greedy generation, without
        jump-forward: the states a constrained sequence really samples in."""
        from minillm.generation.constrained import Guide, schema_to_regex, token_index

        path = []
        for name in SCHEMAS:
            index = token_index(schema_to_regex(SCHEMAS[name]), self.llm.tokenizer)
            guide = Guide(index)
            for token in self.generate(name, jump_forward=False)["token_ids"]:
                path.append((index, guide.state))   # the state the token was sampled in (EOS included)
                guide.advance(token)
        return path

    def mask_step(self, batch: int, temperature: float) -> dict:
        """Seconds per step a batch of constrained rows costs over unconstrained ones (see 2. above)."""
        from minillm.generation.constrained import Guide
        from minillm.generation.sampling import Sampler, SamplingParams, SamplingState

        path = self.visited
        vocab = self.llm.tokenizer.vocab_size
        sampler = Sampler(eos_token_ids=[self.llm.tokenizer.eos_id])
        params = SamplingParams(temperature=temperature, seed=0)
        logits = np.random.default_rng(0).standard_normal((batch, vocab)).astype(np.float32)   # (B, V)
        free = [SamplingState(params) for _ in range(batch)]
        guided = [SamplingState(params) for _ in range(batch)]
        spread = max(1, len(path) // batch)
        free_s = guided_s = 0.0
        for i in range(len(path)):
            for row, state in enumerate(guided):
                index, dfa_state = path[(i + row * spread) % len(path)]
                state.guide = Guide(index)
                state.guide.state = dfa_state
            start = time.perf_counter()
            sampler.sample(logits, free)
            middle = time.perf_counter()
            chosen = sampler.sample(logits, guided).token_ids
            for state, token in zip(guided, chosen):
                state.guide.advance(int(token))
                state.guide.forced_tokens()
            guided_s += time.perf_counter() - middle
            free_s += middle - start
        return {"free_sample_s": free_s / len(path), "guided_sample_s": guided_s / len(path),
                "mask_s": (guided_s - free_s) / len(path), "steps": len(path)}

    def round(self) -> dict:
        """Every minillm measurement once."""
        if not hasattr(self, "visited"):
            self.visited = self._visited()
        out = {"vocabulary_trie_s": self.vocabulary_trie(),
               "index": {name: self.build_index(name) for name in SCHEMAS},
               "generation": {name: {"jump_forward": self.generate(name, True),
                                     "no_jump_forward": self.generate(name, False)} for name in SCHEMAS},
               "mask": {}}
        for batch in BATCHES:
            out["mask"][str(batch)] = {"decode_step_s": self.decode_step(batch), "greedy": self.mask_step(batch, 0.0),
                                       "temperature_0.8": self.mask_step(batch, 0.8)}
        return out


class LlamaCppGrammar(LlamaCpp):
    """llama.cpp's GBNF grammar from a JSON schema, applied by its sampler at every token."""

    def round(self, prompts: dict[str, list[int]]) -> dict:
        out = {"decode_s_per_token": self._decode_per_token(prompts), "schemas": {}}
        for name, ids in prompts.items():
            start = time.perf_counter()
            grammar = self.llama_cpp.LlamaGrammar.from_json_schema(json.dumps(SCHEMAS[name]), verbose=False)
            built = time.perf_counter()
            self.llm.reset()
            reply = self.llm.create_completion(prompt=ids, max_tokens=MAX_TOKENS, temperature=0, grammar=grammar)
            done = time.perf_counter()
            out["schemas"][name] = {"grammar_build_s": built - start, "seconds": done - built,
                                    "text": reply["choices"][0]["text"], "tokens": reply["usage"]["completion_tokens"],
                                    "finish_reason": reply["choices"][0]["finish_reason"]}
        return out

    def _decode_per_token(self, prompts: dict[str, list[int]]) -> float:
        """Seconds per token of unconstrained greedy decoding after the first schema's prompt: the
        time of 1 + DECODE_STEPS tokens less that of the prefill and first token alone."""
        ids = next(iter(prompts.values()))
        self.generate(ids, 1)   # warm
        _, prefill = timed(self.generate, ids, 1)
        _, whole = timed(self.generate, ids, 1 + DECODE_STEPS)
        return (whole - prefill) / DECODE_STEPS


# -----------------------------------------------------------------------------------------------
# The run


def minillm_summary(rounds: list[dict]) -> dict:
    last = rounds[-1]
    index = {name: {**{k: v for k, v in last["index"][name].items() if not k.endswith("_s")},
                    "compile_s": summarize([r["index"][name]["compile_s"] for r in rounds]),
                    "index_s": summarize([r["index"][name]["index_s"] for r in rounds]),
                    "total_s": statistics.median(r["index"][name]["compile_s"] + r["index"][name]["index_s"]
                                                 for r in rounds)} for name in SCHEMAS}
    mask = {}
    for batch in map(str, BATCHES):
        step = summarize([r["mask"][batch]["decode_step_s"] for r in rounds])
        mask[batch] = {"decode_step_s": step}
        for mode in ("greedy", "temperature_0.8"):
            cost = summarize([r["mask"][batch][mode]["mask_s"] for r in rounds])
            runs = [r["mask"][batch][mode] for r in rounds]
            mask[batch][mode] = {"mask_s_per_step": cost, "overhead_fraction": cost["median"] / step["median"],
                                 "free_sample_s": statistics.median(run["free_sample_s"] for run in runs),
                                 "guided_sample_s": statistics.median(run["guided_sample_s"] for run in runs),
                                 "steps_timed": last["mask"][batch][mode]["steps"]}
    generation = {}
    for name in SCHEMAS:
        generation[name] = {}
        for mode in ("jump_forward", "no_jump_forward"):
            runs = [r["generation"][name][mode] for r in rounds]
            problems = [p for run in runs if (p := validate(run["text"], SCHEMAS[name]))]
            generation[name][mode] = {
                "tokens": runs[-1]["tokens"], "forwards": runs[-1]["forwards"],
                "tokens_per_forward": runs[-1]["tokens"] / runs[-1]["forwards"],
                "seconds": summarize([run["seconds"] for run in runs]),
                "finish_reasons": sorted({run["finish_reason"] for run in runs}),
                "valid": f"{len(runs) - len(problems)}/{len(runs)}", "problems": problems, "text": runs[-1]["text"]}
    return {"vocabulary_trie_s": summarize([r["vocabulary_trie_s"] for r in rounds]), "index_build": index,
            "mask_overhead": mask, "generation": generation}


def llama_summary(rounds: list[dict]) -> dict:
    per_token = summarize([r["decode_s_per_token"] for r in rounds])
    schemas = {}
    for name in SCHEMAS:
        runs = [r["schemas"][name] for r in rounds]
        problems = [p for run in runs if (p := validate(run["text"], SCHEMAS[name]))]
        seconds = summarize([run["seconds"] for run in runs])
        tokens = runs[-1]["tokens"]
        schemas[name] = {"grammar_build_s": summarize([run["grammar_build_s"] for run in runs]), "seconds": seconds,
                         "tokens": tokens, "seconds_per_token": seconds["median"] / tokens,
                         "per_token_over_unconstrained_decode": seconds["median"] / tokens / per_token["median"],
                         "finish_reasons": sorted({run["finish_reason"] for run in runs}),
                         "valid": f"{len(runs) - len(problems)}/{len(runs)}", "problems": problems,
                         "text": runs[-1]["text"]}
    return {"decode_s_per_token": per_token, "schemas": schemas}


def load_note(before: float, after: float, cores: int) -> str:
    busy = max(before, after) > 0.75 * cores
    return (f"1-minute load average {before:.1f} before and {after:.1f} after the run, on {cores} cores: "
            + ("a BUSY machine - other jobs shared the cores, so absolute times are inflated and noisy; "
               "ratios taken within one process and moment (mask overhead, tokens per forward) hold up better"
               if busy else "a quiet machine"))


# -----------------------------------------------------------------------------------------------
# --coverage: real-world schemas accepted, greedy answers valid, mask time per token


COVERAGE_SCHEMAS = BENCHMARKS / "data" / "schemas"
COVERAGE_TIMEOUT_S = 20.0
COVERAGE_MAX_TOKENS = 512


def _compile_minillm(schema: dict, queue) -> None:
    from minillm.generation.constrained import JsonGrammar
    from minillm.generation.constrained.budget import ConstraintTooLarge
    from minillm.generation.constrained.json_schema import SchemaError

    start = time.perf_counter()
    try:
        JsonGrammar.of(schema)
        queue.put({"accepted": True, "compile_s": time.perf_counter() - start})
    except (SchemaError, ConstraintTooLarge, ValueError) as err:
        queue.put({"accepted": False, "error": str(err)[:300]})


def _compile_llama_cpp(schema: dict, queue) -> None:
    from llama_cpp import LlamaGrammar   # only where llama-cpp-python is installed

    start = time.perf_counter()
    try:
        LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
        queue.put({"accepted": True, "compile_s": time.perf_counter() - start})
    except Exception as err:   # llama.cpp raises whatever its converter raises
        queue.put({"accepted": False, "error": f"{type(err).__name__}: {str(err)[:300]}"})


def in_own_process(target, schema: dict, timeout: float) -> dict:
    """target(schema, queue) in a fresh process: its answer, or a timeout (the process is killed)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=target, args=(schema, queue))
    process.start()
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()
        return {"accepted": False, "error": f"no answer within {timeout:g} s"}
    return queue.get() if not queue.empty() else {"accepted": False, "error": f"exit code {process.exitcode}"}


def generate_and_time_masks(llm, schema: dict, max_tokens: int) -> dict:
    """A greedy answer under the grammar (valid?), then the mask of each of its steps replayed on a
    cold index at batch 1: the median and the mean seconds of GrammarGuide.allowed + advance."""
    from minillm.generation.constrained import JsonGrammar, new_guide
    from minillm.generation.constrained.grammar_guide import GrammarIndex, json_pushdown
    from minillm.generation.sampling import SamplingParams

    prompt = llm.chat_prompt([{"role": "user", "content": "Write a typical configuration file for this JSON "
                                                          "Schema, as JSON: " + json.dumps(schema)[:1500]}])
    params = SamplingParams(temperature=0, max_tokens=max_tokens, guided_json=schema)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    guide = new_guide(GrammarIndex(json_pushdown(JsonGrammar.of(schema)), llm.tokenizer), max_tokens)
    times = []
    for token in out.token_ids:
        start = time.perf_counter()
        guide.allowed()
        guide.advance(token)
        times.append(time.perf_counter() - start)
    return {"tokens": len(out.token_ids), "finish_reason": out.finish_reason,
            "problem": validate(out.text, schema), "text": out.text[:300],
            "mask_median_s": statistics.median(times) if times else None,
            "mask_mean_s": statistics.fmean(times) if times else None}


def coverage(args) -> None:
    from minillm.llm import LLM
    from minillm.model.fetch import cached_model_path

    try:
        import llama_cpp  # noqa: F401
        llama = True
    except ImportError:
        llama = False
    files = sorted(COVERAGE_SCHEMAS.glob("*.json"))
    if args.schemas:
        files = [f for f in files if f.stem in args.schemas]
    llm, rows = None, {}
    for path in files:
        schema = json.loads(path.read_text())
        row = {"minillm": in_own_process(_compile_minillm, schema, COVERAGE_TIMEOUT_S)}
        if llama:
            row["llama.cpp"] = in_own_process(_compile_llama_cpp, schema, COVERAGE_TIMEOUT_S)
        if row["minillm"]["accepted"]:
            llm = llm or LLM(cached_model_path())
            row["minillm"]["generation"] = generate_and_time_masks(llm, schema, args.max_tokens)
        rows[path.stem] = row
        m = row["minillm"]
        g = m.get("generation", {})
        print(f"{path.stem:<18} minillm {'accepted' if m['accepted'] else 'refused: ' + m['error'][:70]}"
              + (f"  valid={g['problem'] is None} tokens={g['tokens']} mask median "
                 f"{g['mask_median_s'] * 1e6:.0f} us" if g else "")
              + (f"  llama.cpp {'accepted' if row['llama.cpp']['accepted'] else 'refused'}" if llama else ""))
    accepted = [r for r in rows.values() if r["minillm"]["accepted"]]
    medians = [r["minillm"]["generation"]["mask_median_s"] for r in accepted
               if r["minillm"]["generation"]["mask_median_s"] is not None]
    results = {"settings": {"max_tokens": args.max_tokens, "timeout_s": COVERAGE_TIMEOUT_S,
                            "schemas": [f.name for f in files]},
               "schemas": rows,
               "minillm": {"accepted_fraction": len(accepted) / max(len(rows), 1),
                           "valid_fraction": sum(r["minillm"]["generation"]["problem"] is None for r in accepted)
                           / max(len(accepted), 1),
                           "mask_median_s": statistics.median(medians) if medians else None},
               "llama_cpp": ({"accepted_fraction": sum(r["llama.cpp"]["accepted"] for r in rows.values())
                              / max(len(rows), 1)} if llama else {"skipped": "llama-cpp-python is not installed"})}
    print(json.dumps({k: results[k] for k in ("minillm", "llama_cpp")}, indent=1))
    save_result("structured_coverage", results, args.out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=2, help="rounds per contender, taken in turns (default 2)")
    parser.add_argument("--threads", type=int, default=default_threads())
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"folder for structured.json (default: {RESULTS})")
    parser.add_argument("--coverage", action="store_true", help="the public-schema coverage run instead (see above)")
    parser.add_argument("--schemas", nargs="*", help="--coverage: only these schema names (file stems)")
    parser.add_argument("--max-tokens", type=int, default=COVERAGE_MAX_TOKENS, help="--coverage: greedy answer budget")
    args = parser.parse_args()
    if args.coverage:
        return coverage(args)
    load_before = os.getloadavg()[0]
    source = BENCHMARKS / "structured.py"
    workers = {"minillm": Worker(Contender("minillm", "MinillmStructured", source=source), "native", args.threads)}
    skipped = None
    try:
        workers["llama.cpp"] = Worker(Contender("llama.cpp", "LlamaCppGrammar", source=source), "native", args.threads)
    except ContenderUnavailable as err:
        skipped = str(err)
        print(f"skipping {err}")
    prompts, _ = workers["minillm"].call("prompts")
    rounds: dict[str, list[dict]] = {name: [] for name in workers}
    try:
        for turn, name in interleaved(list(workers), args.turns):
            time.sleep(SETTLE_SECONDS)
            result, seconds = workers[name].call("round", **({"prompts": prompts} if name == "llama.cpp" else {}))
            rounds[name].append(result)
            print(f"turn {turn + 1}/{args.turns}: {name} round took {seconds:.1f} s")
    finally:
        for worker in workers.values():
            worker.close()
    results = {"note": load_note(load_before, os.getloadavg()[0], os.cpu_count() or 1),
               "settings": {"turns": args.turns, "threads": args.threads, "max_tokens": MAX_TOKENS,
                            "decode_steps": DECODE_STEPS, "schemas": SCHEMAS, "prompts": PROMPTS},
               "stamps": {name: w.stamp for name, w in workers.items()},
               "minillm": minillm_summary(rounds["minillm"]),
               "llama_cpp": llama_summary(rounds["llama.cpp"]) if "llama.cpp" in rounds else {"skipped": skipped}}
    m = results["minillm"]
    results["goals"] = {
        "mask_overhead_under_10pct_of_a_decode_step": {
            batch: {mode: m["mask_overhead"][batch][mode]["overhead_fraction"] < MASK_OVERHEAD_GOAL
                    for mode in ("greedy", "temperature_0.8")} for batch in m["mask_overhead"]},
        "ten_property_index_under_1s": m["index_build"]["ten_properties"]["total_s"] < INDEX_BUILD_GOAL_S,
        "every_greedy_output_valid": all(g[mode]["problems"] == [] for g in m["generation"].values()
                                         for mode in ("jump_forward", "no_jump_forward"))}
    report(results)
    save_result("structured", results, args.out)


def report(results: dict) -> None:
    m, ll = results["minillm"], results["llama_cpp"]
    print(results["note"])
    print(f"vocabulary trie (once per tokenizer): {m['vocabulary_trie_s']['median']:.2f} s")
    print(f"{'schema':<15}{'regex':>7}{'DFA':>6}{'compile s':>11}{'index s':>9}{'tok/fwd JF':>12}{'no JF':>7}"
          f"{'req s JF':>10}{'no JF':>7}{'valid':>7}{'llama.cpp s':>13}{'valid':>7}")
    for name, idx in m["index_build"].items():
        g = m["generation"][name]
        other = ll.get("schemas", {}).get(name, {})
        print(f"{name:<15}{idx['regex_chars']:>7}{idx['dfa_states']:>6}{idx['compile_s']['median']:>11.2f}"
              f"{idx['index_s']['median']:>9.2f}{g['jump_forward']['tokens_per_forward']:>12.2f}"
              f"{g['no_jump_forward']['tokens_per_forward']:>7.2f}{g['jump_forward']['seconds']['median']:>10.2f}"
              f"{g['no_jump_forward']['seconds']['median']:>7.2f}{g['jump_forward']['valid']:>7}"
              f"{other.get('seconds', {}).get('median', float('nan')):>13.2f}{other.get('valid', '-'):>7}")
    for batch, mask in m["mask_overhead"].items():
        print(f"batch {batch:>2}: decode step {mask['decode_step_s']['median'] * 1e3:.1f} ms; mask overhead per step "
              + ", ".join(f"{mode} {mask[mode]['mask_s_per_step']['median'] * 1e3:.2f} ms "
                          f"({100 * mask[mode]['overhead_fraction']:.1f}%)" for mode in ("greedy", "temperature_0.8"))
              + " (goal < 10%)")
    if "decode_s_per_token" in ll:
        print(f"llama.cpp unconstrained decode: {ll['decode_s_per_token']['median'] * 1e3:.1f} ms/token; with the "
              "grammar: " + ", ".join(f"{name} {s['seconds_per_token'] * 1e3:.0f} ms/token"
                                      for name, s in ll["schemas"].items()))
    print("goals:", json.dumps(results["goals"]))


if __name__ == "__main__":
    main()
