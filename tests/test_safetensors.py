"""The safetensors reader against the `safetensors` package (which writes the files and loads them
back as the oracle) and against transformers' own save_pretrained directories, sharded or not."""
import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file as save_torch

from minillm.model.safetensors import SafetensorsError, SafetensorsFile, load_hf_directory


def test_numpy_dtypes_match_the_safetensors_package(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "f16": rng.standard_normal((4,)).astype(np.float16),
        "i64": rng.integers(-(2**40), 2**40, (2, 2, 2)),
        "i32": rng.integers(-5, 5, (7,)).astype(np.int32),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }
    path = tmp_path / "t.safetensors"
    save_numpy(tensors, path, metadata={"format": "np", "note": "hi"})
    ours = SafetensorsFile(path)
    assert sorted(ours.keys()) == sorted(tensors)
    assert ours.metadata == {"format": "np", "note": "hi"}
    with safe_open(path, framework="np") as oracle:
        for name in tensors:
            expected = oracle.get_tensor(name)
            got = ours.tensor(name)
            assert got.dtype == expected.dtype and got.shape == expected.shape, name
            np.testing.assert_array_equal(got, expected)


def test_bf16_is_widened_exactly_to_float32(tmp_path):
    values = torch.randn(6, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    values[0, :4] = torch.tensor([0.0, -0.0, float("inf"), 1e-40])  # zero signs, inf, a subnormal
    path = tmp_path / "bf16.safetensors"
    save_torch({"w": values}, path)
    got = SafetensorsFile(path).tensor("w")
    assert got.dtype == np.float32 and got.shape == (6, 8)
    expected = values.float().numpy()
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))  # bit for bit


def tiny_llama(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=96, tie_word_embeddings=tie)
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("shard", [False, True])
def test_hf_directory_single_and_sharded(tmp_path, shard):
    model = tiny_llama(tie=False)
    model.save_pretrained(tmp_path, max_shard_size="40KB" if shard else "1GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == shard
    config, tensors = load_hf_directory(tmp_path)
    assert config == json.loads((tmp_path / "config.json").read_text())
    state = model.state_dict()
    assert sorted(tensors) == sorted(state)
    for name, value in state.items():
        np.testing.assert_array_equal(tensors[name], value.numpy(), err_msg=name)


def test_hf_directory_tied_embeddings_store_one_copy(tmp_path):
    tiny_llama(tie=True).save_pretrained(tmp_path)
    config, tensors = load_hf_directory(tmp_path)
    assert config["tie_word_embeddings"] is True
    assert "model.embed_tokens.weight" in tensors and "lm_head.weight" not in tensors


# -----------------------------------------------------------------------------------------------
# Errors

def raw_file(tmp_path, header: bytes, data: bytes = b"", length: int | None = None):
    path = tmp_path / "bad.safetensors"
    path.write_bytes((len(header) if length is None else length).to_bytes(8, "little") + header + data)
    return path


def test_malformed_files_are_named(tmp_path):
    cases = [
        ((b"", b"", None), "truncated file"),
        ((b"{}", b"", 10**6), r"header length 1,000,000 \(bytes 0-7\) runs past the end of the file"),
        ((b"{not json", b"", None), "malformed JSON header"),
        ((b"[1, 2]", b"", None), "header must be a JSON object"),
        ((b'{"w": {"dtype": "F32", "shape": [2]}}', b"", None), "must have dtype, shape and data_offsets"),
        ((b'{"w": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}', b"\0\0", None),
         "tensor 'w' has dtype 'F8_E4M3'"),
        ((b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}}', b"\0" * 8, None),
         r"data_offsets \[0, 16\] run past the end of the data \(8 bytes after the header\)"),
        ((b'{"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}', b"\0" * 8, None),
         r"span 8 bytes, but F32 \[3\] needs 12"),
        ((b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}', b"\0" * 8, None),
         "must be \\[begin, end\\] with 0 <= begin <= end"),
        ((b'{"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 0]}}', b"", None),
         "is not a list of non-negative integers"),
    ]
    for (header, data, length), message in cases:
        if header == b"":
            path = tmp_path / "bad.safetensors"
            path.write_bytes(b"\x01\x02")
        else:
            path = raw_file(tmp_path, header, data, length)
        with pytest.raises(SafetensorsError, match=message):
            SafetensorsFile(path)


def test_truncated_real_file_is_refused(tmp_path):
    path = tmp_path / "t.safetensors"
    save_numpy({"w": np.ones((16, 16), np.float32)}, path)
    data = path.read_bytes()
    path.write_bytes(data[:-4])
    with pytest.raises(SafetensorsError, match="run past the end of the data"):
        SafetensorsFile(path)
    path.write_bytes(data[:20])
    with pytest.raises(SafetensorsError, match="runs past the end of the file"):
        SafetensorsFile(path)


def test_bad_directories_are_named(tmp_path):
    with pytest.raises(SafetensorsError, match="has no config.json"):
        load_hf_directory(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SafetensorsError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_hf_directory(tmp_path)
    save_numpy({"a": np.ones(2, np.float32)}, tmp_path / "shard-1.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"b": "shard-1.safetensors"}}))
    with pytest.raises(SafetensorsError, match="puts 'b' in shard-1.safetensors, which does not hold it"):
        load_hf_directory(tmp_path)
    with pytest.raises(KeyError, match="no tensor named 'zzz'"):
        SafetensorsFile(tmp_path / "shard-1.safetensors").tensor("zzz")
