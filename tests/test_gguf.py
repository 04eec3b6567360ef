"""The GGUF reader and writer against the oracles: the `gguf` package's GGUFReader (llama.cpp's own
Python reader), the facts of REFERENCE.md about the real SmolLM2 file, and the real file itself
(written back by write_gguf, it must come out byte for byte identical)."""
import filecmp

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from minillm.kernels.cpu.quant import QMatrix, quantize
from minillm.model.gguf import GGUFError, GGUFFile, GGUFValue, write_gguf

VALUE_TYPE_NAMES = {GGUFValueType.UINT8: "u8", GGUFValueType.INT8: "i8", GGUFValueType.UINT16: "u16",
                    GGUFValueType.INT16: "i16", GGUFValueType.UINT32: "u32", GGUFValueType.INT32: "i32",
                    GGUFValueType.FLOAT32: "f32", GGUFValueType.BOOL: "bool", GGUFValueType.STRING: "string",
                    GGUFValueType.ARRAY: "array", GGUFValueType.UINT64: "u64", GGUFValueType.INT64: "i64",
                    GGUFValueType.FLOAT64: "f64"}


def oracle_type(field) -> str:
    """GGUFReader's field.types ([ARRAY, ARRAY, INT32] ...) spelled as our metadata_types ('array[array[i32]]')."""
    names = [VALUE_TYPE_NAMES[t] for t in field.types]
    if names == ["array"]:  # an empty array: GGUFReader drops its element type
        return "array"
    return "".join(f"{n}[" for n in names[:-1]) + names[-1] + "]" * (len(names) - 1)


def oracle_leaves(field) -> list:
    """Every scalar a field holds, nested arrays flattened, as GGUFReader decodes them."""
    leaf = field.types[-1]
    decode = (lambda p: bytes(p).decode("utf-8")) if leaf == GGUFValueType.STRING else (lambda p: p.tolist()[0])
    return [decode(field.parts[i]) for i in field.data]


def flatten(value) -> list:
    if isinstance(value, str) or not isinstance(value, (list, np.ndarray)):
        return [value]
    return [leaf for item in value for leaf in flatten(item)]


# -----------------------------------------------------------------------------------------------
# The real file: facts, and agreement with GGUFReader

@pytest.fixture(scope="module")
def real(smollm2_path):
    return GGUFFile(smollm2_path), GGUFReader(smollm2_path)


@pytest.mark.slow
def test_real_file_facts(real, smollm2_path):
    g, _ = real
    assert smollm2_path.stat().st_size == 98_362_432
    assert (g.version, g.alignment, len(g.tensors)) == (3, 32, 272)
    m = g.metadata
    assert m["general.architecture"] == "llama"
    assert (m["llama.block_count"], m["llama.embedding_length"], m["llama.feed_forward_length"]) == (30, 576, 1536)
    assert (m["llama.attention.head_count"], m["llama.attention.head_count_kv"]) == (9, 3)
    assert m["llama.rope.freq_base"] == 100000.0 and m["llama.context_length"] == 8192
    assert m["llama.attention.layer_norm_rms_epsilon"] == np.float32(1e-5)
    assert m["llama.vocab_size"] == 49152 and len(m["tokenizer.ggml.tokens"]) == 49152
    assert len(m["tokenizer.ggml.merges"]) == 48900
    assert (m["tokenizer.ggml.model"], m["tokenizer.ggml.pre"]) == ("gpt2", "smollm")
    assert (m["tokenizer.ggml.bos_token_id"], m["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert m["tokenizer.ggml.add_bos_token"] is False
    assert m["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert "output.weight" not in g.tensors  # tied embeddings
    assert g.type_counts == {"Q8_0": 1, "Q4_1": 210, "F32": 61}
    embd = g.tensors["token_embd.weight"]
    assert (embd.shape, embd.ggml_type, embd.nbytes) == ((49152, 576), "Q8_0", 49152 * 576 // 32 * 34)
    assert g.tensors["blk.0.ffn_down.weight"].shape == (576, 1536)  # (out, in): NumPy order
    assert g.tensors["blk.0.attn_k.weight"].shape == (192, 576)
    layer_bytes = sum(t.nbytes for t in g.tensors.values() if t.ggml_type == "Q4_1")
    assert 65e6 < layer_bytes < 67e6  # "≈ 66 MB of layers"


@pytest.mark.slow
def test_real_metadata_matches_gguf_reader(real):
    ours, reader = real
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}  # not the header
    assert list(ours.metadata) == list(fields)
    for key, field in fields.items():
        assert ours.metadata_types[key] == oracle_type(field), key
        assert ours.metadata_offsets[key] == field.offset, key
        assert flatten(ours.metadata[key]) == oracle_leaves(field), key


@pytest.mark.slow
def test_real_tensors_match_gguf_reader(real):
    ours, reader = real
    assert ours.data_offset == reader.data_offset
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(int(d) for d in reversed(t.shape)), t.name
        assert (info.ggml_type, info.offset, info.nbytes) == (t.tensor_type.name, t.data_offset, t.n_bytes), t.name
        data = ours.tensor(t.name)
        raw = data.data if isinstance(data, QMatrix) else data
        assert raw.tobytes() == np.asarray(t.data).tobytes(), t.name


@pytest.mark.slow
def test_tensors_are_zero_copy_views(real):
    g, _ = real
    norm = g.tensor("blk.0.attn_norm.weight")
    assert norm.dtype == np.float32 and norm.shape == (576,) and not norm.flags.owndata
    qm = g.tensor("blk.0.ffn_up.weight")
    assert qm.qtype == "Q4_1" and qm.shape == (1536, 576) and qm.data.shape == (1536, 576 // 32 * 20)
    assert not qm.data.flags.owndata and not qm.data.flags.writeable


@pytest.mark.slow
def test_real_file_written_back_is_byte_identical(real, smollm2_path, tmp_path):
    g, _ = real
    metadata = {k: GGUFValue(v, g.metadata_types[k].removeprefix("array[").removesuffix("]"))
                for k, v in g.metadata.items()}
    out = write_gguf(tmp_path / "copy.gguf", metadata, {name: g.tensor(name) for name in g.tensors})
    assert filecmp.cmp(smollm2_path, out, shallow=False)


# -----------------------------------------------------------------------------------------------
# write_gguf: every value type, read back by both readers

def every_value_type() -> tuple[dict, dict]:
    """(metadata to write, the type each key must get)."""
    metadata = {
        "general.architecture": ("llama", "string"),
        "t.u8": (GGUFValue(200, "u8"), "u8"), "t.i8": (GGUFValue(-100, "i8"), "i8"),
        "t.u16": (GGUFValue(60000, "u16"), "u16"), "t.i16": (GGUFValue(-30000, "i16"), "i16"),
        "t.u32": (4_000_000_000, "u32"), "t.i32": (-5, "i32"), "t.u64": (2**40, "u64"), "t.i64": (-(2**40), "i64"),
        "t.f32": (0.5, "f32"), "t.f64": (GGUFValue(1 / 3, "f64"), "f64"), "t.bool": (True, "bool"),
        "t.string": ("héllo ✓ 漢字", "string"), "t.np_f32": (np.float32(2.5), "f32"),
        "a.strings": (["a", "", "ü"], "array[string]"), "a.ints": ([1, -2, 3], "array[i32]"),
        "a.big_ints": ([1, 2**40], "array[i64]"), "a.floats": ([0.5, 1], "array[f32]"),
        "a.bools": ([True, False], "array[bool]"), "a.u8": (np.array([1, 255], np.uint8), "array[u8]"),
        "a.f64": (np.array([0.1, 0.2]), "array[f64]"), "a.forced": (GGUFValue([1, 2], "u64"), "array[u64]"),
        "a.empty": (GGUFValue([], "string"), "array[string]"),
        "a.nested": ([[1, 2], [3]], "array[array[i32]]"),
        "a.nested_strings": ([["x"], ["y", "z"]], "array[array[string]]"),
    }
    return {k: v for k, (v, _) in metadata.items()}, {k: t for k, (_, t) in metadata.items()}


def some_tensors() -> dict:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 64)).astype(np.float32)
    return {"cube": rng.standard_normal((3, 4, 5)).astype(np.float32),
            "half": rng.standard_normal(7).astype(np.float16),
            "q8": quantize(w, "Q8_0"), "q40": quantize(w, "Q4_0"), "q41": quantize(w, "Q4_1")}


@pytest.mark.parametrize("alignment", [32, 64])
def test_write_gguf_round_trip_through_both_readers(tmp_path, alignment):
    metadata, types = every_value_type()
    tensors = some_tensors()
    path = write_gguf(tmp_path / "all.gguf", metadata, tensors, alignment=alignment)

    ours, reader = GGUFFile(path), GGUFReader(path)
    assert ours.version == 3 and ours.alignment == alignment == reader.alignment
    expected = {k: (v.value if isinstance(v, GGUFValue) else v) for k, v in metadata.items()}
    for key, value in expected.items():  # every value here is exact in its GGUF type
        assert ours.metadata_types[key] == types[key], key
        assert flatten(ours.metadata[key]) == flatten(value), key
        assert oracle_leaves(reader.fields[key]) == flatten(value), key
        if flatten(value):  # GGUFReader keeps no element type for an empty array
            assert oracle_type(reader.fields[key]) == types[key], key
    assert ours.metadata["t.f32"] == 0.5 and ours.metadata["t.f64"] == 1 / 3  # f64 kept all its bits

    theirs = {t.name: t for t in reader.tensors}
    for name, tensor in tensors.items():
        info, got = ours.tensors[name], ours.tensor(name)
        assert info.offset % alignment == 0 and info.offset == theirs[name].data_offset
        if isinstance(tensor, QMatrix):
            assert (got.qtype, got.shape) == (tensor.qtype, tensor.shape) == (theirs[name].tensor_type.name, (4, 64))
            np.testing.assert_array_equal(got.data, tensor.data)
            np.testing.assert_array_equal(np.asarray(theirs[name].data), tensor.data)
        else:
            assert got.dtype == tensor.dtype and info.shape == tensor.shape
            np.testing.assert_array_equal(got, tensor)
            np.testing.assert_array_equal(np.asarray(theirs[name].data).reshape(tensor.shape), tensor)


def test_write_gguf_refuses_what_it_cannot_store(tmp_path):
    out = tmp_path / "x.gguf"
    with pytest.raises(ValueError, match="tensor 'w' is float64"):
        write_gguf(out, {}, {"w": np.zeros(4)})
    with pytest.raises(ValueError, match="empty list has no element type"):
        write_gguf(out, {"k": []}, {})
    with pytest.raises(ValueError, match="one kind of value"):
        write_gguf(out, {"k": [1, "a"]}, {})
    with pytest.raises(ValueError, match="does not fit in 64 bits"):
        write_gguf(out, {"k": 2**64}, {})
    with pytest.raises(ValueError, match="does not fit in u8"):
        write_gguf(out, {"k": GGUFValue(256, "u8")}, {})
    with pytest.raises(ValueError, match="power of two"):
        write_gguf(out, {}, {}, alignment=48)


# -----------------------------------------------------------------------------------------------
# Every reader error names the problem and the byte offset

def small_file(tmp_path) -> bytes:
    tensors = {"first.weight": np.ones((2, 3), np.float32),
               "second.weight": quantize(np.ones((2, 64), np.float32), "Q4_1")}
    path = write_gguf(tmp_path / "small.gguf", {"general.architecture": "llama", "a.n": [1, 2, 3]}, tensors)
    return path.read_bytes()


def read_bytes_as_gguf(tmp_path, data: bytes) -> GGUFFile:
    path = tmp_path / "forged.gguf"
    path.write_bytes(data)
    return GGUFFile(path)


def tensor_info_offset(data: bytes, name: str) -> int:
    """Byte offset of a tensor-table entry: where its name's u64 length starts."""
    return data.index(name.encode()) - 8


def test_bad_magic(tmp_path):
    data = small_file(tmp_path)
    with pytest.raises(GGUFError, match=r"not a GGUF file: .*at byte offset 0"):
        read_bytes_as_gguf(tmp_path, b"GGML" + data[4:])


def test_unsupported_version(tmp_path):
    data = small_file(tmp_path)
    with pytest.raises(GGUFError, match=r"unsupported GGUF version 4 .*at byte offset 4"):
        read_bytes_as_gguf(tmp_path, data[:4] + (4).to_bytes(4, "little") + data[8:])


def test_every_truncation_is_named(tmp_path):
    data = small_file(tmp_path)
    good = GGUFFile(tmp_path / "small.gguf")
    data_end = max(t.offset + t.nbytes for t in good.tensors.values())
    for cut in range(data_end):
        with pytest.raises(GGUFError) as err:
            read_bytes_as_gguf(tmp_path, data[:cut])
        message = str(err.value)
        if cut < good.tensor_infos_offset + 1:
            assert "truncated file" in message, (cut, message)
        else:
            assert "truncated file" in message or "tensor data out of bounds" in message, (cut, message)
        offset = int(message.rsplit("at byte offset ", 1)[1].rstrip(")"))
        assert offset <= cut, (cut, message)


@pytest.mark.slow
def test_truncated_copies_of_the_real_file(smollm2_path, tmp_path):
    data = smollm2_path.read_bytes()
    with pytest.raises(GGUFError, match=r"truncated file: .*element \d+ of 'tokenizer.ggml.tokens'"):
        read_bytes_as_gguf(tmp_path, data[:500_000])
    with pytest.raises(GGUFError, match=r"tensor data out of bounds: 'blk.\d+.\w+.weight'"):
        read_bytes_as_gguf(tmp_path, data[:50_000_000])


def test_forged_tensor_type(tmp_path):
    data = bytearray(small_file(tmp_path))
    entry = tensor_info_offset(data, "second.weight")
    type_at = entry + 8 + len("second.weight") + 4 + 2 * 8  # name, n_dims, 2 dims
    assert int.from_bytes(data[type_at:type_at + 4], "little") == 3  # Q4_1, as written
    data[type_at:type_at + 4] = (14).to_bytes(4, "little")  # Q6_K
    with pytest.raises(GGUFError) as err:
        read_bytes_as_gguf(tmp_path, bytes(data))
    message = str(err.value)
    assert "unsupported tensor type: tensor 'second.weight' is Q6_K (ggml type id 14)" in message
    assert "supports F32 (0), F16 (1), BF16 (30), Q8_0 (8), Q4_0 (2), Q4_1 (3)" in message
    assert "the file's tensors are F32 x1, Q6_K x1" in message
    assert f"at byte offset {entry})" in message


def test_forged_data_offset_out_of_bounds(tmp_path):
    data = bytearray(small_file(tmp_path))
    entry = tensor_info_offset(data, "first.weight")
    offset_at = entry + 8 + len("first.weight") + 4 + 2 * 8 + 4
    data[offset_at:offset_at + 8] = (10**6).to_bytes(8, "little")
    with pytest.raises(GGUFError, match=rf"tensor data out of bounds: 'first.weight' \(F32, 24 bytes\) "
                                        rf"starts at byte .* past the end of the file .*at byte offset {entry}\)"):
        read_bytes_as_gguf(tmp_path, bytes(data))


def test_forged_metadata_value_type(tmp_path):
    data = bytearray(small_file(tmp_path))
    key_at = data.index(b"a.n") - 8
    type_at = key_at + 8 + 3
    data[type_at:type_at + 4] = (13).to_bytes(4, "little")
    with pytest.raises(GGUFError, match=rf"unknown metadata value type 13 for key 'a.n' .*at byte offset {type_at}\)"):
        read_bytes_as_gguf(tmp_path, bytes(data))


def test_empty_file_and_missing_tensor(tmp_path):
    with pytest.raises(GGUFError, match="truncated file: the magic number"):
        read_bytes_as_gguf(tmp_path, b"")
    small_file(tmp_path)
    with pytest.raises(KeyError, match="no tensor named 'third.weight'"):
        GGUFFile(tmp_path / "small.gguf").tensor("third.weight")
