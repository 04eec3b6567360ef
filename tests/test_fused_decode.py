"""The fused decode path (minillm/kernels/cpu/fused_decode.py): the decoder layers in one compiled call.

The oracle is the per-op forward it stands in for (minillm/model/layers.py, held to transformers by
test_transformer.py): the fused layer calls the same kernels on the same values in the same order,
so its logits - and the K/V it writes into the paged cache - must be the per-op path's bit for bit,
in exact (fp32) and int8 activation mode, for Llama and for Qwen3 (QK-norm). The per-op path is
forced the way the course seats a learner's decoder layer: by replacing
minillm.model.transformer.decoder_layer (here with a wrapper around the package's own).

Tiny random models are written as GGUF files (benchmarks/tiny_model.py) with mixed formats (Q4_1 qkv, Q8_0 attn_output, Q4_0
gate/up, Q4_1 down), so that each matrix's code layout reaches its own kernel. The slow tests run
the real SmolLM2-135M: greedy tokens and logits of 16 decode steps at batch 1 and 3.
"""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import minillm.model.layers as layers
import minillm.model.transformer as transformer
from minillm.generation.sampling import SamplingParams
from minillm.hardware.machine import compile_target
from minillm.kernels.cpu import fused_decode
from minillm.kernels.cpu.quant_repack import repack
from minillm.kernels.registry import Backend, OPS, get_backend
from minillm.llm import load_tokenizer
from minillm.model.kv_cache import AttentionMetadata
from minillm.model.loader import load_model
from minillm.runtime.engine import LLMEngine
from minillm.runtime.paged_cache import PagedAttentionMetadata, PagedKVCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from tiny_model import TinyShape, write_tiny_gguf  # noqa: E402  (benchmarks/ is a folder of scripts)

SHAPE = TinyShape(vocab=96, hidden=64, ffn=96, layers=2, heads=4, kv_heads=2, head_dim=16, context=1024)
VOCAB, LAYERS, HEADS, KV_HEADS, HEAD_DIM = SHAPE.vocab, SHAPE.layers, SHAPE.heads, SHAPE.kv_heads, SHAPE.head_dim
# every code layout reaches its own kernel
QTYPES = {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_1", "attn_output": "Q8_0",
          "ffn_gate": "Q4_0", "ffn_up": "Q4_0", "ffn_down": "Q4_1"}
BLOCK_SIZE, NUM_BLOCKS = 4, 320


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fused")
    return {arch: write_tiny_gguf(folder / f"tiny-{arch}.gguf", arch, shape=SHAPE, qtypes=QTYPES)
            for arch in ("llama", "qwen3")}


@pytest.fixture(scope="module")
def tiny_models(tiny_files):
    """(arch, activations) -> a loaded model (numba backend, weights repacked)."""
    return {(arch, act): load_model(path, activations=act)
            for arch, path in tiny_files.items() for act in ("fp32", "int8")}


class PerOp:
    """Within the block the forward takes the per-op path, as when the course seats a learner's
    decoder layer; ``calls`` counts the layers it ran."""

    def __init__(self, monkeypatch):
        self.monkeypatch, self.calls = monkeypatch, 0

    def __enter__(self):
        def seated(*args):
            self.calls += 1
            return layers.decoder_layer(*args)
        self.monkeypatch.setattr(transformer, "decoder_layer", seated)
        return self

    def __exit__(self, *exc):
        self.monkeypatch.setattr(transformer, "decoder_layer", layers.decoder_layer)


def tables_for(n_seqs: int, blocks_each: int) -> list[list[int]]:
    """Each sequence's blocks, interleaved and backwards (block order in the pool means nothing)."""
    pool = np.arange(n_seqs * blocks_each)[::-1]
    return [pool[b::n_seqs].tolist() for b in range(n_seqs)]


def run_steps(model, prompt_lens, steps, seed=0, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS):
    """Prefill each prompt (random tokens), then ``steps`` greedy decode steps of the whole batch,
    on a fresh paged cache -> (logits of each decode step [(B, V)], the cache)."""
    rng = np.random.default_rng(seed)
    n = len(prompt_lens)
    cache = PagedKVCache(model.config, num_blocks, block_size, model.ops)
    tables = tables_for(n, num_blocks // n)
    prompts = [rng.integers(0, model.config.vocab_size, size) for size in prompt_lens]
    meta = PagedAttentionMetadata.build(prompt_lens, [0] * n, tables, block_size)
    tokens = model.forward(np.concatenate(prompts), meta, cache).argmax(-1)  # (B,)
    context, out = list(prompt_lens), []
    for _ in range(steps):
        meta = PagedAttentionMetadata.build([1] * n, context, tables, block_size)
        logits = model.forward(tokens, meta, cache)  # (B, V)
        out.append(logits)
        tokens = logits.argmax(-1)
        context = [c + 1 for c in context]
    return out, cache


def assert_same_steps(fused, per_op):
    (fused_logits, fused_cache), (per_op_logits, per_op_cache) = fused, per_op
    for step, (a, b) in enumerate(zip(fused_logits, per_op_logits)):
        np.testing.assert_array_equal(a, b, err_msg=f"decode step {step}")
    np.testing.assert_array_equal(fused_cache.k, per_op_cache.k)
    np.testing.assert_array_equal(fused_cache.v, per_op_cache.v)


# -----------------------------------------------------------------------------
# bit for bit the per-op path

CASES = [(arch, act, batch) for arch in ("llama", "qwen3") for act in ("fp32", "int8") for batch in (1, 3)]


@pytest.mark.parametrize("arch,activations,batch", CASES, ids=[f"{a}-{m}-batch{b}" for a, m, b in CASES])
def test_decode_steps_are_bit_identical_to_the_per_op_path(tiny_models, monkeypatch, arch, activations, batch):
    model = tiny_models[arch, activations]
    prompt_lens, steps = [9, 14, 11][:batch], 6  # prompts of > 8 rows prefill on the per-op path
    before = model.fused_decode_steps
    fused = run_steps(model, prompt_lens, steps)
    assert model.fused_decode_steps - before == steps, "every decode step should take the fused path"
    with PerOp(monkeypatch) as per_op:
        reference = run_steps(model, prompt_lens, steps)
    assert per_op.calls == (steps + 1) * LAYERS
    assert model.fused_decode_steps - before == steps
    assert_same_steps(fused, reference)


def test_a_long_context_splits_the_keys_into_chunks_and_stays_identical(tiny_models, monkeypatch):
    """Past 2 x SPLIT_MIN_KEYS keys one query's attention runs in chunks (flash-decoding)."""
    model = tiny_models["llama", "fp32"]
    fused = run_steps(model, [600], 3)
    assert fused_decode.key_chunks(1, KV_HEADS, np.array([601])) > 1
    with PerOp(monkeypatch):
        reference = run_steps(model, [600], 3)
    assert_same_steps(fused, reference)


def test_a_verify_sized_batch_uses_the_chunk_kernel_and_stays_identical(tiny_models, monkeypatch):
    """Rows of several tokens per sequence (a speculative verify): up to MAX_ROWS rows run fused."""
    model = tiny_models["qwen3", "fp32"]

    def verify(n_rows):
        lens = [3, 1, n_rows - 4]
        cache = PagedKVCache(model.config, NUM_BLOCKS, BLOCK_SIZE, model.ops)
        tables = tables_for(3, NUM_BLOCKS // 3)
        rng = np.random.default_rng(5)
        prompts = [12, 7, 10]
        meta = PagedAttentionMetadata.build(prompts, [0] * 3, tables, BLOCK_SIZE)
        model.forward(rng.integers(0, VOCAB, sum(prompts)), meta, cache)
        meta = PagedAttentionMetadata.build(lens, prompts, tables, BLOCK_SIZE, logits_indices=np.arange(n_rows))
        return model.forward(rng.integers(0, VOCAB, n_rows), meta, cache), cache

    before = model.fused_decode_steps
    fused_logits, fused_cache = verify(fused_decode.MAX_ROWS)
    assert model.fused_decode_steps == before + 1
    with PerOp(monkeypatch):
        reference_logits, reference_cache = verify(fused_decode.MAX_ROWS)
    assert_same_steps(([fused_logits], fused_cache), ([reference_logits], reference_cache))
    verify(fused_decode.MAX_ROWS + 1)  # one row more: the matvec range ends, the per-op path runs
    assert model.fused_decode_steps == before + 1


def test_an_early_exit_draft_runs_its_layers_fused_and_stays_identical(tiny_models, monkeypatch):
    """forward(num_layers=1), as the self-speculative drafter calls it, between full forwards."""
    model = tiny_models["llama", "int8"]

    def draft_then_full():
        cache = PagedKVCache(model.config, NUM_BLOCKS, BLOCK_SIZE, model.ops)
        tables = tables_for(2, NUM_BLOCKS // 2)
        model.forward(np.arange(20), PagedAttentionMetadata.build([9, 11], [0, 0], tables, BLOCK_SIZE), cache)
        meta = PagedAttentionMetadata.build([1, 1], [9, 11], tables, BLOCK_SIZE)
        draft = model.forward(np.array([4, 7]), meta, cache, num_layers=1)
        return [draft, model.forward(np.array([4, 7]), meta, cache)], cache

    before = model.fused_decode_steps
    fused = draft_then_full()
    assert model.fused_decode_steps == before + 2
    with PerOp(monkeypatch):
        reference = draft_then_full()
    assert_same_steps(fused, reference)


def test_rows_padded_to_the_row_group_stay_identical(tiny_files, monkeypatch):
    """Rows per group that do not divide a matrix's rows: the kernels' padded outputs are cut."""
    model = load_model(tiny_files["llama"])
    for w in model.weights.layers:
        w.qkv, w.gate_up = (repack(w.qkv[0], "fp32", 6),), (repack(w.gate_up[0], "fp32", 6),)
        w.wo, w.w_down = repack(w.wo, "fp32", 6), repack(w.w_down, "fp32", 6)
    assert model.weights.layers[0].qkv[0].groups * 6 != (HEADS + 2 * KV_HEADS) * HEAD_DIM
    fused = run_steps(model, [10], 3)
    assert model.fused_decode_steps == 3
    with PerOp(monkeypatch):
        reference = run_steps(model, [10], 3)
    assert_same_steps(fused, reference)


def test_layers_of_different_layouts_run_as_runs_and_stay_identical(tiny_files, monkeypatch):
    """Layers whose weights are repacked otherwise than their neighbours' (another R): each run of
    alike layers is one compiled call, and the step is still the per-op path's bit for bit."""
    model = load_model(tiny_files["llama"], activations="int8")
    w = model.weights.layers[1]
    R = 3 * w.wo.rows_per_group  # 48 (24 with AVX2 code): it divides qmatmul's tiles, which the prefill runs
    w.qkv, w.gate_up = (repack(w.qkv[0], "int8", R),), (repack(w.gate_up[0], "int8", R),)
    w.wo, w.w_down = repack(w.wo, "int8", R), repack(w.w_down, "int8", R)
    runs = model._fused_layers(LAYERS)
    assert [(first, len(weights[0])) for _, first, weights in runs] == [(0, 1), (1, 1)]
    fused = run_steps(model, [10], 3)
    assert model.fused_decode_steps == 3
    with PerOp(monkeypatch):
        reference = run_steps(model, [10], 3)
    assert_same_steps(fused, reference)


def test_typed_list_is_numbas_list_of_the_same_arrays():
    """The compiled builder gives what numba.typed.List(arrays) gives: its type, the arrays themselves
    (no copies: the layers' weights are not duplicated), in order; each item type and length a builder."""
    from numba import typeof
    from numba.typed import List

    rng = np.random.default_rng(0)
    for arrays in ([rng.integers(0, 255, (4, 6), dtype=np.uint8) for _ in range(3)],
                   [rng.standard_normal(5).astype(np.float32) for _ in range(2)], [np.empty(0, np.float32)]):
        built = fused_decode.typed_list(tuple(arrays))
        assert typeof(built) == typeof(List(arrays)) and len(built) == len(arrays)
        for got, array in zip(built, arrays):
            assert got.ctypes.data == array.ctypes.data and got.shape == array.shape and got.dtype == array.dtype


@pytest.mark.parametrize("activations", ["fp32", "int8"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_the_fused_linear_is_qlinear_bit_for_bit(tiny_models, activations, tokens):
    """linear_rows, called from Python, against the per-op path's qlinear: every code layout."""
    weights = tiny_models["llama", activations].weights.layers[0]
    x = np.random.default_rng(1).standard_normal((tokens, weights.wo.shape[1])).astype(np.float32)
    isa = fused_decode.EXACT if activations == "fp32" else fused_decode.quant_int8.TARGET_ISA
    for w in (weights.wo, weights.w_down, weights.qkv[0]):
        x_in = x if w.shape[1] == x.shape[1] else np.resize(x, (tokens, w.shape[1]))
        got = fused_decode.linear_rows(w.quants, w.scales, w.mins, x_in, w.shape[0],
                                       fused_decode.quant_fp32.QTYPE_CODES[w.qtype], w.rows_per_group, tokens, isa)
        np.testing.assert_array_equal(got, get_backend("numba").qlinear(x_in, w))


# -----------------------------------------------------------------------------
# where the per-op path runs instead

def steps_taken(model, cache_class=PagedKVCache):
    """Decode steps of a short run that took the fused path."""
    before = model.fused_decode_steps
    cache = cache_class(model.config, 16, BLOCK_SIZE, model.ops)
    meta = PagedAttentionMetadata.build([9], [0], [list(range(16))], BLOCK_SIZE)
    token = model.forward(np.arange(9), meta, cache).argmax(-1)
    for position in (9, 10):
        token = model.forward(token, PagedAttentionMetadata.build([1], [position], [list(range(16))], BLOCK_SIZE),
                              cache).argmax(-1)
    return model.fused_decode_steps - before


def test_a_seated_decoder_layer_runs_instead(tiny_models, monkeypatch):
    model = tiny_models["llama", "fp32"]
    assert steps_taken(model) == 2
    with PerOp(monkeypatch) as seated:
        assert steps_taken(model) == 0
    assert seated.calls == 3 * LAYERS


@pytest.mark.parametrize("name", ["self_attention", "swiglu_mlp", "linear", "linear_stacked", "decoder_layer"])
def test_a_replaced_function_of_the_layers_runs_instead(tiny_models, monkeypatch, name):
    model = tiny_models["qwen3", "fp32"]
    calls = []
    original = getattr(layers, name)
    monkeypatch.setattr(layers, name, lambda *args: calls.append(name) or original(*args))
    assert steps_taken(model) == 0
    if name != "decoder_layer":  # the model calls transformer.decoder_layer, which calls the rest
        assert calls


def test_a_learner_kernel_in_the_backend_runs_instead(tiny_models):
    """Any op not the numba backend's own (a learner's kernel, a timer's wrapper) keeps the per-op path."""
    model = tiny_models["llama", "int8"]
    numba_ops = get_backend("numba")
    for op in fused_decode.FUSED_OPS:
        calls = []
        ops = {name: getattr(numba_ops, name) for name in OPS}
        ops[op] = lambda *args, op=op: calls.append(op) or getattr(numba_ops, op)(*args)
        learner = transformer.Model(model.config, model.weights, Backend("exercises", ops))
        assert steps_taken(learner) == 0, op
        assert calls, op
    package_ops = {name: getattr(numba_ops, name) for name in OPS}
    same = transformer.Model(model.config, model.weights, Backend("numba-again", package_ops))
    assert steps_taken(same) == 2  # another Backend object holding the package's own kernels fuses


def test_the_reference_backend_a_cache_that_writes_otherwise_and_a_tensor_parallel_rank_run_per_op(tiny_files, tiny_models):
    assert steps_taken(load_model(tiny_files["qwen3"], backend="reference")) == 0

    class WritesCounted(PagedKVCache):
        writes = 0

        def write(self, *args):
            WritesCounted.writes += 1
            super().write(*args)

    class Renamed(PagedKVCache):
        pass

    model = tiny_models["qwen3", "fp32"]
    assert steps_taken(model, WritesCounted) == 0 and WritesCounted.writes == 3 * LAYERS
    assert steps_taken(model, Renamed) == 2  # it writes and attends as PagedKVCache does
    rank = transformer.Model(model.config, model.weights, model.ops)
    rank.context = dataclasses.replace(rank.context, all_reduce=lambda x: x)  # as ShardedModel does
    assert steps_taken(rank) == 0


def test_a_contiguous_cache_runs_per_op(tiny_models):
    model = tiny_models["llama", "fp32"]
    before = model.fused_decode_steps
    cache = model.new_cache(1, 16)
    model.forward(np.arange(4), AttentionMetadata([4], [0], [0]), cache)
    model.forward(np.array([3]), AttentionMetadata([1], [4], [0]), cache)
    assert model.fused_decode_steps == before


# -----------------------------------------------------------------------------
# checked once a step, as the per-op wrappers check every call

# A decode step whose shapes passed once checks its values in one compiled pass (DecodeStep): each
# bad value is refused on a batch's first step and on a later one alike.

@pytest.mark.parametrize("shape_seen_before", [False, True])
def test_a_slot_outside_the_cache_is_refused_before_any_write(tiny_models, shape_seen_before):
    model = tiny_models["llama", "fp32"]
    cache = PagedKVCache(model.config, 5, BLOCK_SIZE, model.ops)
    fused_decode.DECODE_SHAPES_CHECKED.clear()
    if shape_seen_before:
        model.forward(np.array([1]), PagedAttentionMetadata.build([1], [3], [[4]], BLOCK_SIZE), cache)
    cache.k[:4] = 0
    meta = PagedAttentionMetadata.build([1], [3], [[0]], BLOCK_SIZE)
    meta.slot_mapping[:] = 5 * BLOCK_SIZE  # one past the last slot
    with pytest.raises(ValueError, match="slots must lie in"):
        model.forward(np.array([1]), meta, cache)
    assert not cache.k[:4].any(), "nothing may be written before the check"


@pytest.mark.parametrize("shape_seen_before", [False, True])
def test_a_block_table_naming_a_missing_block_is_refused(tiny_models, shape_seen_before):
    model = tiny_models["qwen3", "int8"]
    cache = PagedKVCache(model.config, 4, BLOCK_SIZE, model.ops)
    fused_decode.DECODE_SHAPES_CHECKED.clear()
    if shape_seen_before:
        model.forward(np.array([1]), PagedAttentionMetadata.build([1], [5], [[0, 1]], BLOCK_SIZE), cache)
    meta = PagedAttentionMetadata.build([1], [5], [[0, 9]], BLOCK_SIZE)
    meta.slot_mapping[:] = 1  # a slot that exists: only the table is wrong
    with pytest.raises(ValueError, match="block tables name blocks"):
        model.forward(np.array([1]), meta, cache)


def test_a_position_past_the_rope_tables_is_refused_on_a_shape_seen_before(tiny_models):
    model = tiny_models["llama", "fp32"]
    n_positions = len(model.context.cos)
    blocks = -(-(n_positions + 1) // BLOCK_SIZE)
    cache = PagedKVCache(model.config, blocks, BLOCK_SIZE, model.ops)
    model.forward(np.array([1]), PagedAttentionMetadata.build([1], [3], [list(range(blocks))], BLOCK_SIZE), cache)
    meta = PagedAttentionMetadata.build([1], [3], [list(range(blocks))], BLOCK_SIZE)
    meta.positions[:] = n_positions  # past the tables (the model's own check is on context_lens)
    with pytest.raises(ValueError, match="rope positions must lie in"):
        fused_decode.DecodeStep(meta, cache.k, cache.v, model.config.n_layers, model.context.cos,
                                model.context.sin, model.config.rope_style, model.config.rms_eps,
                                transformer._fused_dims(model.config))


# -----------------------------------------------------------------------------
# the AVX2 code path, compiled in a process of its own

@pytest.mark.skipif(compile_target().isa == "avx2", reason="this process already runs the AVX2 code path")
def test_the_avx2_code_path_is_bit_identical_too(tiny_files):
    """NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES="": the tests above, on AVX2 code (4 rows a group,
    the AVX2 int8 dot products), in a subprocess; a few cases keep the compile time down."""
    env = os.environ | {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": ""}
    selection = "bit_identical_to_the_per_op_path and (llama-fp32-batch3 or qwen3-int8)"
    code = ("import sys, pytest\n"
            "from minillm.hardware.machine import compile_target\n"
            "from minillm.kernels.cpu import quant_int8, quant_repack\n"
            "assert compile_target().isa == 'avx2' and quant_int8.TARGET_ISA == quant_int8.AVX2\n"
            "assert quant_repack.ROWS_PER_GROUP == 4\n"
            f"sys.exit(pytest.main([{__file__!r}, '-q', '-p', 'no:cacheprovider', '-k', {selection!r}]))\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "3 passed" in done.stdout, done.stdout[-1000:]


# -----------------------------------------------------------------------------
# the real model

@pytest.fixture(scope="module", params=["fp32", "int8"])
def smollm2(request, smollm2_path):
    return load_model(smollm2_path, activations=request.param), load_tokenizer(smollm2_path)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 3])
def test_smollm2_decode_logits_are_bit_identical(smollm2, monkeypatch, batch):
    model, prompt_lens = smollm2[0], [21, 9, 30][:batch]
    before = model.fused_decode_steps
    fused = run_steps(model, prompt_lens, 16, seed=batch, block_size=16, num_blocks=12)
    assert model.fused_decode_steps - before == 16 + (sum(prompt_lens) <= fused_decode.MAX_ROWS)
    with PerOp(monkeypatch):
        reference = run_steps(model, prompt_lens, 16, seed=batch, block_size=16, num_blocks=12)
    assert_same_steps(fused, reference)


@pytest.mark.slow
def test_smollm2_greedy_tokens_through_the_engine_are_the_per_op_tokens(smollm2, monkeypatch):
    model, tokenizer = smollm2
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [42] * 12, list(range(100, 130))]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def generate(batch):
        engine = LLMEngine(model, tokenizer, block_size=16)
        ids = [engine.add_request(p, params) for p in prompts[:batch]]
        while engine.has_unfinished():
            engine.step()
        return [engine.pop_request(i).outputs[0].token_ids for i in ids]

    for batch in (1, 3):
        before = model.fused_decode_steps
        fused = generate(batch)
        assert model.fused_decode_steps - before >= 15, "the engine's decode steps should run fused"
        with PerOp(monkeypatch):
            assert generate(batch) == fused
