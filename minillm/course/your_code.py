"""SmolLM2 on your code: every task of the chapters so far where the engine runs it, each counted
as it is reached, and the tokens beside the package's.

Runs, each made twice - on the package, then on the learner's pieces - and compared token by token:
    greedy     one request on a contiguous fp32 KV cache (chapter 06's Generation)
    sampled    a seeded request (temperature 0.8, top_p 0.9) on an int8 KV cache     (from ch04)
    engine     three requests through the paged engine, on a KV budget too small for all three
               at once, so that the scheduler preempts                               (from ch07)
    serve      one streamed completion through the OpenAI server app, then /metrics  (from ch09)
    speculate  one repetitive request through the engine speculating with n-grams   (from ch10)
    speculate_sampled   the same, sampled (temperature 0.8, top_k 1, seeded)         (from ch10)
    constrained         one request through the engine under guided_regex            (from ch11)
    cuda       chapter 03's kernels in a tiny model's forward, in a process of its own (from ch03)
    routing    chapter 12's shared-prefix workload through the replica set's cache-aware policy,
               replica by replica (no Ray: the policy is pure Python)               (from ch12)
    tensor_parallel     the greedy request on 2 ranks (spawned processes), each rank's SwiGLU
               block through column_row_linear, beside the one-process greedy run  (from ch12)
Chapter 01's roofline and decode ceiling predict the decode speed the greedy run then measures.

The sampled speculative run verifies its drafts by rejection sampling, whose rule draws random
numbers in an order of its own choosing: two correct rules, the same seed, may keep different
tokens. top_k 1 makes every target distribution one token, so that any correct rule keeps a draft
token exactly when it is that token and otherwise draws it: the run's tokens are fixed, and the
learner's compare token by token. (It proves the rule's accept, residual and bonus paths, not its
arithmetic on spread-out probabilities: chapter 10's tests grade that.)
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from minillm.course import cuda_seat, server_run, tensor_parallel_seat
from minillm.course.learner_ops import Reach, learner_backend
from minillm.course.seats import CALL, CUDA, HOOK, KERNEL, SEATS, learner_pieces, learner_seats, tasks_up_to, written
from minillm.course.tasks import task
from minillm.generation.generate import Generation
from minillm.generation.sampling import SamplingParams
from minillm.llm import LLM, load_tokenizer
from minillm.model import loader, sharding
from minillm.model.fetch import cached_model_path, fetch
from minillm.model.quality import Int8KVCache
from minillm.model.transformer import Model
from minillm.runtime.config import EngineConfig
from minillm.runtime.paged_cache import bytes_per_token
from minillm.serve.router import make_policy

ENGINE_PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
SPECULATE_PROMPT = "one two three four five one two three four five one two three four five one two"
ENGINE_BLOCK_SIZE = 4    # small blocks: a sequence needs new ones as it decodes, so the scheduler
# preempts when the budget - one and a half sequences' worth, for three sequences - runs out
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=0)
# disable_by_batch_size: the fixed rule (one sequence: every draft verified whole), so that every step
# of the speculative runs drafts and runs the learner's acceptance rules; the engine's default rule
# would weigh measured step times first, and might keep a short run plain
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 1}
SPECULATE_SAMPLED = dict(temperature=0.8, top_k=1, seed=0)   # one token per target distribution: see above
CONSTRAINED_PROMPT = "Is Paris the capital of France? Answer with one word, yes, no or maybe:"
CONSTRAINED_REGEX = "(yes|no|maybe)"
ENGINE_RUNS = ("engine", "speculate", "speculate_sampled", "constrained")


@dataclass
class Piece:
    task: str
    whose: str       # "yours", or "package (why)"
    reached: int     # calls of the learner's code during the runs (0: not reached)
    where: str


@dataclass(repr=False)
class YourCodeResult:
    pieces: list[Piece]
    package_tokens: list[int]   # the greedy run's
    your_tokens: list[int]
    runs: dict[str, tuple[tuple, tuple]] = field(default_factory=dict)  # run -> (package's, yours), each
    # (token ids of each request, what else the run reports)

    @property
    def equal(self) -> bool:
        return all(package[0] == yours[0] for package, yours in self.runs.values())

    @property
    def yours(self) -> list[str]:
        return [p.task for p in self.pieces if p.whose == "yours"]

    @property
    def reached(self) -> list[str]:
        return [p.task for p in self.pieces if p.whose == "yours" and p.reached > 0]

    def __repr__(self) -> str:  # one line: a notebook cell ending with your_code(...) echoes it
        tokens = "the package's tokens" if self.equal else "not the package's tokens"
        return (f"YourCodeResult({len(self.yours)} of {len(self.pieces)} pieces yours, {len(self.reached)} reached: "
                f"{tokens} in {len(self.runs)} runs)")


def your_code(chapter: str = "ch02", prompt: str = "The capital of France is", max_tokens: int = 12,
              model: str | Path | None = None) -> YourCodeResult:
    """Run SmolLM2 on the learner's pieces of chapters 01 .. `chapter` and on the package's, print
    which pieces were the learner's and how often each was called, and the tokens side by side."""
    path = Path(model) if model is not None else (cached_model_path() or fetch())
    reach = Reach()
    runs = _runs(path, chapter, prompt, max_tokens, reach)
    prediction = _prediction(path, chapter, reach, runs.pop("_decode_tokens_per_s"))
    pieces = [_piece(marker, reach) for marker in tasks_up_to(chapter)]
    _print_pieces(chapter, pieces)
    (package_greedy, _), (your_greedy, _) = runs["greedy"]
    result = YourCodeResult(pieces, package_greedy[0], your_greedy[0], runs)
    _print_tokens(path, prompt, result)
    for line in prediction:
        print(line)
    return result


# ----------------------------------------------------------------------------------------------
# the runs

def _runs(path: Path, chapter: str, prompt: str, max_tokens: int, reach: Reach) -> dict:
    package_model = loader.load_model(path)
    kv = _preempting_budget(load_tokenizer(path), package_model, max_tokens)
    runs, package = {}, _each_run(path, package_model, chapter, prompt, max_tokens, kv)
    decode_tokens_per_s = package["greedy"][1]
    with learner_seats(chapter, reach):
        yours = _each_run(path, _learner_model(path, chapter, reach), chapter, prompt, max_tokens, kv)
    for name in package:
        runs[name] = (package[name], yours[name])
    if chapter >= "ch03":
        runs["cuda"] = cuda_seat.run(chapter, reach)
    if chapter >= "ch12":
        runs["routing"] = _routing(chapter, load_tokenizer(path), reach)
        runs["tensor_parallel"] = _tensor_parallel(path, prompt, max_tokens, package["greedy"], reach)
    runs["_decode_tokens_per_s"] = decode_tokens_per_s
    return runs


def _each_run(path: Path, model: Model, chapter: str, prompt: str, max_tokens: int, kv: dict) -> dict:
    """The runs of chapters up to ``chapter`` on ``model``, each on a tokenizer of its own (the
    learner's bpe_merge encodes the prompts of the learner's runs)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    runs = {"greedy": _single(model, load_tokenizer(path), prompt, greedy)}
    if chapter >= "ch04":
        runs["sampled"] = _single(model, load_tokenizer(path), prompt, SamplingParams(max_tokens=max_tokens, **SAMPLED),
                                  int8_kv=True)
    if chapter >= "ch07":
        runs["engine"] = _engine(path, model, ENGINE_PROMPTS, greedy, **kv)
    if chapter >= "ch09":
        runs["serve"] = server_run.serve_run(path, model, prompt, max_tokens)
    if chapter >= "ch10":
        runs["speculate"] = _engine(path, model, [SPECULATE_PROMPT], greedy, speculative=SPECULATIVE)
        runs["speculate_sampled"] = _engine(path, model, [SPECULATE_PROMPT],
                                            SamplingParams(max_tokens=max_tokens, **SPECULATE_SAMPLED),
                                            speculative=SPECULATIVE)
    if chapter >= "ch11":
        runs["constrained"] = _engine(path, model, [CONSTRAINED_PROMPT],
                                      SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                     guided_regex=CONSTRAINED_REGEX))
    return runs


def _preempting_budget(tokenizer, model: Model, max_tokens: int) -> dict:
    """Engine arguments whose KV cache holds the longest of ENGINE_PROMPTS' sequences one and a half
    times: all three start, then decoding runs out of blocks and the scheduler must preempt."""
    longest = max(len(tokenizer.encode(p)) for p in ENGINE_PROMPTS) + max_tokens
    blocks = -(-longest // ENGINE_BLOCK_SIZE) * 3 // 2
    return {"block_size": ENGINE_BLOCK_SIZE, "kv_cache_bytes": blocks * ENGINE_BLOCK_SIZE * bytes_per_token(model.config)}


def _learner_model(path: Path, chapter: str, reach: Reach) -> Model:
    """The model on the learner's backend; with chapter 05's rope convention written, its Q/K rows
    put in Hugging Face order by it (loader.unpermute_qk_rows, swapped) and rotated by halves."""
    backend = learner_backend(reach)
    reach.clear()  # the backend's probes called the kernels once each: only what the model runs counts
    config, weights = loader.read_weights(path)
    if chapter >= "ch05" and written("ch05_rope_convention") and config.rope_style == "pairs":
        layers = [dataclasses.replace(layer, wq=loader.unpermute_qk_rows(layer.wq, config.n_heads),
                                      wk=loader.unpermute_qk_rows(layer.wk, config.n_kv_heads))
                  for layer in weights.layers]
        config, weights = dataclasses.replace(config, rope_style="half"), dataclasses.replace(weights, layers=layers)
    return Model(config, weights, backend)


def _single(model: Model, tokenizer, prompt: str, params: SamplingParams, int8_kv: bool = False):
    """(tokens, decode tokens/s) of one request on a contiguous cache (int8 K/V if asked)."""
    generation = Generation(model, tokenizer, tokenizer.encode(prompt), params)
    if int8_kv:
        generation.cache = Int8KVCache(model.config, 1, generation.cache.max_len)
    tokens = generation.run().token_ids
    tpot = generation.timings().tpot_s
    return [tokens], (1 / tpot if tpot else None)


def _engine(path: Path, model: Model, prompts: list[str], params: SamplingParams, **engine_args):
    """(tokens of each prompt, preemptions) through the paged engine running ``model``."""
    with _loading(model):
        llm = LLM(path, **engine_args)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs], llm.engine.stats().num_preemptions
    finally:
        llm.close()


@contextlib.contextmanager
def _loading(model: Model):
    """LLM(...) builds its engine on ``model`` instead of loading one."""
    import minillm.llm as llm_module
    original = llm_module.load_model
    llm_module.load_model = lambda *args, **kwargs: model
    try:
        yield
    finally:
        llm_module.load_model = original


# ----------------------------------------------------------------------------------------------
# chapter 12: routing

ROUTING_REPLICAS = 2
ROUTING_IN_FLIGHT = 6  # arrivals a routed request stays in flight: loads build up, so the rule's
# imbalance limit decides some requests as well as its prefix affinity


def _routing(chapter: str, tokenizer, reach: Reach) -> tuple[tuple, tuple]:
    """Chapter 12's shared-prefix workload routed by the package's cache-aware rule, then by the
    learner's (``router.cache_aware_choice`` swapped): (replica of each request, requests per replica), each."""
    from minillm.serve.replicas import SharedPrefixWorkload  # the workload measure_routing sends
    prompts = SharedPrefixWorkload().prompts(tokenizer)
    package = _route(prompts)
    with learner_seats(chapter, reach):
        yours = _route(prompts)
    return package, yours


def _route(prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """The policy a ReplicaSet builds for routing="cache-aware" choosing a replica for each prompt in
    turn, with the loads ReplicaSet.submit keeps: +1 when routed, -1 when it finishes, here
    ROUTING_IN_FLIGHT arrivals later."""
    policy = make_policy("cache-aware", EngineConfig().block_size)
    in_flight, choices = [0] * ROUTING_REPLICAS, []
    for i, prompt in enumerate(prompts):
        if i >= ROUTING_IN_FLIGHT:
            in_flight[choices[i - ROUTING_IN_FLIGHT]] -= 1
        choice = policy.choose(prompt, in_flight)
        in_flight[choice] += 1
        choices.append(choice)
    return [choices], [choices.count(r) for r in range(ROUTING_REPLICAS)]


def _tensor_parallel(path: Path, prompt: str, max_tokens: int, one_process: tuple,
                     reach: Reach) -> tuple[tuple, tuple]:
    """The greedy request on tensor_parallel_seat.TP_SIZE ranks, each rank's MLP through the learner's
    column_row_linear (the package's until it is written), beside the package's one-process greedy
    run: (([tokens], "one process"), ([tokens], (what happened, each rank's calls))). Only this seat is
    the learner's in the ranks: a difference is the split's. The ranks count their calls themselves."""
    marker = tensor_parallel_seat.MARKER
    mine = written(marker)
    fn = learner_pieces(marker)["column_row_linear"] if mine else sharding.column_row_linear
    tokens, how, calls = tensor_parallel_seat.run(path, prompt, max_tokens, fn)
    if mine:
        reach[marker] += sum(c for c in calls if c)
    return (one_process[0], "one process"), (tokens, (how, calls))


# ----------------------------------------------------------------------------------------------
# chapter 01: the prediction the greedy run measures

def _prediction(path: Path, chapter: str, reach: Reach, measured: float | None) -> list[str]:
    """Chapter 01's decode ceiling and roofline, the learner's functions, on this machine's measured
    bandwidth and FLOP/s and SmolLM2's bytes, beside the decode speed the package's greedy run measured."""
    if not (written("ch01_decode_ceiling") and written("ch01_roofline")):
        return ["\nchapter 01: write attainable_flops and decode_ceiling_tokens_per_s to predict the decode speed"]
    from minillm.hardware.microbench import MIB, fma_flops, measure_bandwidth

    n_params, n_bytes = _weights_read_per_token(loader.read_weights(path)[1])
    bandwidth = measure_bandwidth("read", 512 * MIB, repeats=3).bandwidth_gbs * 1e9
    peak = fma_flops().gflops * 1e9
    pieces = {name: reach.counted(marker, fn) for marker in ("ch01_roofline", "ch01_decode_ceiling")
              for name, fn in learner_pieces(marker).items()}
    try:
        ceiling = float(pieces["decode_ceiling_tokens_per_s"](n_params, n_bytes / n_params, bandwidth))
        intensity = 2 * n_params / n_bytes  # FLOP per byte of a decode step: 2 per weight read
        roof = float(pieces["attainable_flops"](intensity, peak, bandwidth))
    except Exception as err:  # the learner's code raised: say so, the runs above stand
        return [f"\nchapter 01: your functions raised {type(err).__name__}: {err}"]
    lines = [f"\nchapter 01, your functions on this machine ({bandwidth / 1e9:.1f} GB/s DRAM read, "
             f"{peak / 1e9:.0f} GFLOP/s FMA), SmolLM2 reading {n_bytes / 1e6:.0f} MB a token:",
             f"  decode ceiling     {ceiling:7.1f} tok/s",
             f"  roofline at {intensity:.2f} FLOP/byte: {roof / 1e9:.1f} GFLOP/s -> {roof / (2 * n_params):7.1f} tok/s"]
    if measured:
        lines.append(f"  measured (the package's greedy run above): {measured:.1f} tok/s, "
                     f"{measured / ceiling:.0%} of the ceiling")
    return lines


def _weights_read_per_token(weights) -> tuple[int, int]:
    """(parameters, bytes) a decode step reads: every layer's matrices and norms, the final norm and
    the LM head (the embedding table of a tied model); the embedding lookup reads one row only."""
    from minillm.kernels.cpu.quant import QMatrix

    def size(w) -> tuple[int, int]:
        if isinstance(w, QMatrix):
            return w.shape[0] * w.shape[1], w.data.nbytes
        return w.size, w.nbytes

    tensors = [weights.final_norm, weights.lm_head]
    for layer in weights.layers:
        tensors += [layer.attn_norm, layer.mlp_norm, layer.wo, layer.w_down, *layer.qkv, *layer.gate_up]
    sizes = [size(t) for t in tensors]
    return sum(n for n, _ in sizes), sum(b for _, b in sizes)


# ----------------------------------------------------------------------------------------------
# the table

def _piece(marker: str, reach: Reach) -> Piece:
    seat = SEATS[marker]
    if seat.kind == HOOK:
        return Piece(marker, "package (no seat yet)", 0, seat.note)
    if seat.kind == KERNEL:
        from minillm.kernels.registry import get_backend
        whose = get_backend("exercises").tasks[marker]
        whose = "yours" if whose.startswith("yours") else whose
    elif seat.kind == CUDA:
        whose = cuda_seat.whose(marker)
    else:
        whose = "yours" if written(marker) else "package (not written yet)"
    where = seat.note if seat.kind in (KERNEL, CALL, CUDA) else ", ".join(
        f"{m}.{a}" for m, a in seat.targets) + (f" - {seat.note}" if seat.note else "")
    return Piece(marker, whose, reach[marker] if whose == "yours" else 0, where)


def _print_pieces(chapter: str, pieces: list[Piece]) -> None:
    print(f"SmolLM2 on your code, chapters 01-{chapter[2:]}:")
    width = max(len(p.task) for p in pieces)
    for p in pieces:
        reached = f"reached {p.reached}x" if p.reached else ("NOT REACHED" if p.whose == "yours" else "")
        print(f"  {p.task:<{width}}  {p.whose[:48]:<48}  {reached:<14}  {p.where}")
    if not any(p.whose == "yours" for p in pieces):
        print("Nothing is yours yet: every piece is the package's, so both runs below are the package's.")


def _print_tokens(path: Path, prompt: str, result: YourCodeResult) -> None:
    tokenizer = load_tokenizer(path)
    print(f"\ngreedy, prompt {prompt!r}:")
    print(f"  {'#':>3}  {'package':<22}{'yours':<22}")
    package, yours = result.package_tokens, result.your_tokens
    for i in range(max(len(package), len(yours))):
        theirs = package[i] if i < len(package) else None
        mine = yours[i] if i < len(yours) else None
        cell = lambda t: "-" if t is None else f"{t} {tokenizer.decode([t])!r}"  # noqa: E731
        print(f"  {i:>3}  {cell(theirs):<22}{cell(mine):<22}{'' if theirs == mine else '<- differs'}")
    for name, (theirs, mine) in result.runs.items():
        if name != "greedy":
            print(f"{name}: {'the same' if theirs[0] == mine[0] else 'NOT the same'} as the package's "
                  f"({_describe(name, theirs, mine)})")
    print("the same tokens in every run" if result.equal else "the runs differ: check() the pieces marked yours")


def _describe(name: str, outcome: tuple, yours: tuple) -> str:
    """The package's outcome of a run (the tensor-parallel run: the learner's) in a few words."""
    tokens, extra = outcome
    if name == "tensor_parallel":
        how, calls = yours[1]
        counts = " + ".join("?" if c is None else str(c) for c in calls)
        return f"{how}; column_row_linear called {counts} times, rank by rank"
    if name in ENGINE_RUNS:
        return f"{len(tokens)} requests, {sum(map(len, tokens))} tokens, {extra} preemptions"
    if name == "cuda":
        return f"a tiny model's argmax tokens on {extra}"
    if name == "routing":
        return f"{len(tokens[0])} requests routed, {extra} to each replica"
    if name == "serve":
        return f"the streamed text and its latencies: {tokens[1]}; {extra}"
    return f"{sum(map(len, tokens))} tokens"
