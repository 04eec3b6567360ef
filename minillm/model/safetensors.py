"""safetensors, read from scratch, and Hugging Face model directories built on it.

Layout: an 8-byte little-endian header length N, N bytes of JSON

    {"name": {"dtype": "F32", "shape": [out, in], "data_offsets": [begin, end]}, ...,
     "__metadata__": {"format": "pt"}}                      (optional, str -> str)

then the raw row-major data, offsets counted from the byte after the header. We map the file once
and return zero-copy NumPy views; BF16, which NumPy lacks, is widened to float32 (it is the top
half of an fp32, so the widening is exact).
"""
from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

HEADER_LENGTH_BYTES = 8
DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
          "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
          "U8": np.dtype("u1"), "BOOL": np.dtype("?")}


class SafetensorsError(ValueError):
    """A safetensors file or model directory we cannot read; the message names the problem."""


class SafetensorsFile:
    """A memory-mapped .safetensors file: .keys(), .tensor(name), .metadata, .dtypes, .shapes."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        if size < HEADER_LENGTH_BYTES:
            raise self._error(f"truncated file: {size} bytes, less than the {HEADER_LENGTH_BYTES}-byte header length")
        n = int.from_bytes(self._buf[:HEADER_LENGTH_BYTES], "little")
        if HEADER_LENGTH_BYTES + n > size:
            raise self._error(f"header length {n:,} (bytes 0-7) runs past the end of the file ({size:,} bytes)")
        try:
            header = json.loads(bytes(self._buf[HEADER_LENGTH_BYTES:HEADER_LENGTH_BYTES + n]))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._error(f"malformed JSON header (bytes 8-{7 + n}): {e}") from None
        if not isinstance(header, dict):
            raise self._error(f"the header must be a JSON object, got {type(header).__name__}")

        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.data_offset = HEADER_LENGTH_BYTES + n
        data_size = size - self.data_offset
        self.dtypes: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._spans: dict[str, tuple[int, int]] = {}
        for name, entry in header.items():
            dtype, shape, span = self._check_entry(name, entry, data_size)
            self.dtypes[name], self.shapes[name], self._spans[name] = dtype, shape, span

    def _error(self, problem: str) -> SafetensorsError:
        return SafetensorsError(f"{self.path.name}: {problem}")

    def _check_entry(self, name: str, entry: Any, data_size: int):
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise self._error(f"tensor {name!r}: header entry must have dtype, shape and data_offsets, got {entry!r}")
        dtype, shape, span = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPES:
            raise self._error(f"tensor {name!r} has dtype {dtype!r}; supported: {', '.join(DTYPES)}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise self._error(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(span, list) and len(span) == 2 and all(isinstance(o, int) for o in span)
                and 0 <= span[0] <= span[1]):
            raise self._error(f"tensor {name!r}: data_offsets {span!r} must be [begin, end] with 0 <= begin <= end")
        if span[1] > data_size:
            raise self._error(f"tensor {name!r}: data_offsets {span} run past the end of the data "
                              f"({data_size:,} bytes after the header)")
        expected = int(np.prod(shape)) * DTYPES[dtype].itemsize
        if span[1] - span[0] != expected:
            raise self._error(f"tensor {name!r}: data_offsets {span} span {span[1] - span[0]:,} bytes, "
                              f"but {dtype} {shape} needs {expected:,}")
        return dtype, tuple(shape), (span[0], span[1])

    def keys(self) -> list[str]:
        return list(self._spans)

    def __contains__(self, name: str) -> bool:
        return name in self._spans

    def __repr__(self):
        return f"SafetensorsFile({self.path.name!r}, {len(self._spans)} tensors)"

    def tensor(self, name: str) -> np.ndarray:
        """A zero-copy view of the tensor (BF16 widened to float32; F16 stays float16)."""
        if name not in self._spans:
            raise KeyError(f"{self.path.name} has no tensor named {name!r}")
        begin, end = self._spans[name]
        dtype, shape = DTYPES[self.dtypes[name]], self.shapes[name]
        values = np.frombuffer(self._buf, dtype, (end - begin) // dtype.itemsize, self.data_offset + begin)
        if self.dtypes[name] == "BF16":
            values = (values.astype(np.uint32) << 16).view(np.float32)
        return values.reshape(shape)


def load_hf_directory(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A Hugging Face model directory -> (config.json as a dict, {tensor name: array}).

    Weights come from model.safetensors, or from the shards that model.safetensors.index.json lists.
    """
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise SafetensorsError(f"{path} is not a Hugging Face model directory: it has no config.json")
    config = json.loads(config_path.read_text())

    index_path = path / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        shards = {name: SafetensorsFile(path / name) for name in sorted(set(weight_map.values()))}
        tensors = {}
        for name, shard in weight_map.items():
            if name not in shards[shard]:
                raise SafetensorsError(f"{index_path.name} puts {name!r} in {shard}, which does not hold it")
            tensors[name] = shards[shard].tensor(name)
        return config, tensors
    if (path / "model.safetensors").is_file():
        single = SafetensorsFile(path / "model.safetensors")
        return config, {name: single.tensor(name) for name in single.keys()}
    raise SafetensorsError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
