"""GGUF, read and written from scratch: one memory-mapped file holding a model's metadata and tensors.

Layout (little-endian throughout):

    header        magic "GGUF", u32 version, u64 tensor count, u64 metadata count
    metadata      per entry: string key, u32 value type, value  (strings: u64 length + UTF-8 bytes;
                  arrays: u32 element type, u64 count, elements - arrays of arrays nest this)
    tensor infos  per tensor: string name, u32 n_dims, u64 dims[n_dims] (fastest-varying first),
                  u32 ggml type, u64 offset relative to the data section
    padding       up to the next multiple of general.alignment (default 32)
    data          the tensors' bytes, each starting on an aligned offset

`GGUFFile` maps the file once and hands out zero-copy NumPy views of it (or `QMatrix` views of the
packed blocks), so opening a 100 MB model costs a page-table entry, not a copy. `write_gguf` is the
inverse, small enough for tests and for saving models we quantize ourselves.
"""
from __future__ import annotations

import mmap
import os
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from minillm.kernels.quant_formats import BLOCK_BYTES, BLOCK_SIZE, QMatrix

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # v2 and v3 share one layout (v3 only allowed big-endian files)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml tensors have at most 4 dimensions

# -----------------------------------------------------------------------------------------------
# Type tables

# Metadata value types: id -> name; scalar names map to their little-endian NumPy dtype.
VALUE_TYPES = {0: "u8", 1: "i8", 2: "u16", 3: "i16", 4: "u32", 5: "i32", 6: "f32", 7: "bool",
               8: "string", 9: "array", 10: "u64", 11: "i64", 12: "f64"}
VALUE_TYPE_IDS = {name: i for i, name in VALUE_TYPES.items()}
SCALAR_FORMATS = {"u8": "<B", "i8": "<b", "u16": "<H", "i16": "<h", "u32": "<I", "i32": "<i", "f32": "<f",
                  "bool": "<?", "u64": "<Q", "i64": "<q", "f64": "<d"}
SCALAR_DTYPES = {"u8": np.dtype("<u1"), "i8": np.dtype("<i1"), "u16": np.dtype("<u2"),
                 "i16": np.dtype("<i2"), "u32": np.dtype("<u4"), "i32": np.dtype("<i4"),
                 "f32": np.dtype("<f4"), "bool": np.dtype("<u1"), "u64": np.dtype("<u8"),
                 "i64": np.dtype("<i8"), "f64": np.dtype("<f8")}

# ggml tensor types: every id we can name; the reader supports the ones in SUPPORTED_TYPES.
GGML_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
                   9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
                   16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
                   22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
                   29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}
GGML_TYPE_IDS = {name: i for i, name in GGML_TYPE_NAMES.items()}
FLOAT_TYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}  # bytes per element
SUPPORTED_TYPES = ("F32", "F16", "BF16", *BLOCK_BYTES)  # BLOCK_BYTES: Q8_0, Q4_0, Q4_1


class GGUFError(ValueError):
    """A GGUF file we cannot read; the message names the problem and the byte offset."""


def ggml_type_name(type_id: int) -> str:
    return GGML_TYPE_NAMES.get(type_id, f"unknown type {type_id}")


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table. shape is in NumPy order, (out, in) for a linear weight;
    offset is the absolute byte offset of the tensor's data in the file."""

    name: str
    shape: tuple[int, ...]
    ggml_type: str
    offset: int
    nbytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


def tensor_nbytes(shape: tuple[int, ...], ggml_type: str) -> int:
    n = int(np.prod(shape))
    if ggml_type in FLOAT_TYPE_BYTES:
        return n * FLOAT_TYPE_BYTES[ggml_type]
    return n // BLOCK_SIZE * BLOCK_BYTES[ggml_type]


# -----------------------------------------------------------------------------------------------
# Reading

class _Cursor:
    """Reads little-endian values from the mapped file, checking every read against its end."""

    def __init__(self, buf, path: Path):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def error(self, problem: str, offset: int | None = None) -> GGUFError:
        return GGUFError(f"{self.path.name}: {problem} (at byte offset {self.pos if offset is None else offset})")

    def need(self, n: int, what: str) -> None:
        if self.pos + n > self.size:
            raise self.error(f"truncated file: {what} needs {n:,} bytes but the file ends at byte {self.size:,}")

    def scalar(self, type_name: str, what: str):
        fmt = SCALAR_FORMATS[type_name]
        self.need(struct.calcsize(fmt), what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def array(self, type_name: str, count: int, what: str) -> np.ndarray:
        dtype = SCALAR_DTYPES[type_name]
        self.need(count * dtype.itemsize, what)
        values = np.frombuffer(self.buf, dtype, count, self.pos)
        self.pos += count * dtype.itemsize
        return values.astype(bool if type_name == "bool" else dtype.newbyteorder("="))  # a copy: own it

    def string(self, what: str) -> str:
        start = self.pos
        length = self.scalar("u64", f"length of {what}")
        self.need(length, what)
        raw = bytes(self.buf[self.pos:self.pos + length])
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.error(f"{what} is not valid UTF-8", start) from None


def _read_value(cur: _Cursor, type_id: int, key: str) -> tuple[Any, str]:
    """One metadata value of type `type_id` -> (value, type name such as 'u32' or 'array[string]')."""
    if type_id not in VALUE_TYPES:
        raise cur.error(f"unknown metadata value type {type_id} for key {key!r}", cur.pos - 4)
    type_name = VALUE_TYPES[type_id]
    if type_name == "string":
        return cur.string(f"the string value of {key!r}"), type_name
    if type_name != "array":
        return cur.scalar(type_name, f"the {type_name} value of {key!r}"), type_name

    element_id = cur.scalar("u32", f"the array element type of {key!r}")
    count = cur.scalar("u64", f"the array length of {key!r}")
    if element_id not in VALUE_TYPES:
        raise cur.error(f"unknown array element type {element_id} for key {key!r}", cur.pos - 12)
    element = VALUE_TYPES[element_id]
    if element == "string":
        return [cur.string(f"element {i} of {key!r}") for i in range(count)], "array[string]"
    if element == "array":  # nested: each element is (u32 element type, u64 count, elements)
        items = [_read_value(cur, element_id, key) for _ in range(count)]
        inner = items[0][1] if items else "array"
        return [value for value, _ in items], f"array[{inner}]"
    return cur.array(element, count, f"the {count:,} {element} elements of {key!r}"), f"array[{element}]"


class GGUFFile:
    """A GGUF file, memory-mapped: header, metadata and tensor table parsed, tensors on demand.

    .version, .alignment, .metadata (dict), .metadata_types (key -> 'u32', 'array[string]', ...),
    .metadata_offsets (key -> byte offset of its entry), .tensors (name -> TensorInfo),
    .type_counts (ggml type -> number of tensors), .tensor_infos_offset, .data_offset,
    .tensor(name) -> np.ndarray or QMatrix.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # mmap cannot map an empty file; b"" makes the cursor report it as truncated instead.
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        self.file_size = size
        cur = _Cursor(self._buf, self.path)

        # -- header
        cur.need(4, "the magic number")
        magic = bytes(self._buf[0:4])
        if magic != GGUF_MAGIC:
            # the file's own bytes stay out of the message: it may be anything (a key, a private file)
            raise cur.error(f"not a GGUF file: it does not start with the magic number {GGUF_MAGIC!r}", 0)
        cur.pos = 4
        self.version = cur.scalar("u32", "the version")
        if self.version not in SUPPORTED_VERSIONS:
            raise cur.error(f"unsupported GGUF version {self.version} (this reader reads versions "
                            f"{', '.join(map(str, SUPPORTED_VERSIONS))})", 4)
        n_tensors = cur.scalar("u64", "the tensor count")
        n_metadata = cur.scalar("u64", "the metadata count")

        # -- metadata
        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, str] = {}
        self.metadata_offsets: dict[str, int] = {}
        for i in range(n_metadata):
            start = cur.pos
            key = cur.string(f"the key of metadata entry {i}")
            if key in self.metadata:
                raise cur.error(f"duplicate metadata key {key!r}", start)
            type_id = cur.scalar("u32", f"the value type of {key!r}")
            self.metadata[key], self.metadata_types[key] = _read_value(cur, type_id, key)
            self.metadata_offsets[key] = start

        self.alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(self.alignment, int) or self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise cur.error(f"general.alignment = {self.alignment!r} is not a positive power of two",
                            self.metadata_offsets["general.alignment"])

        # -- tensor infos
        self.tensor_infos_offset = cur.pos
        table = []  # (name, shape, type id, relative offset, byte offset of the entry)
        for i in range(n_tensors):
            start = cur.pos
            name = cur.string(f"the name of tensor {i}")
            n_dims = cur.scalar("u32", f"the dimension count of {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise cur.error(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)", start)
            dims = [cur.scalar("u64", f"dimension {d} of {name!r}") for d in range(n_dims)]
            type_id = cur.scalar("u32", f"the type of {name!r}")
            offset = cur.scalar("u64", f"the data offset of {name!r}")
            table.append((name, tuple(reversed(dims)), type_id, offset, start))
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment  # round up

        # -- tally the types, refuse what we cannot decode, check every tensor lies inside the file
        self.type_counts = dict(Counter(ggml_type_name(t) for _, _, t, _, _ in table))
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, type_id, offset, start in table:
            ggml_type = ggml_type_name(type_id)
            if ggml_type not in SUPPORTED_TYPES:
                tally = ", ".join(f"{t} x{n}" for t, n in self.type_counts.items())
                raise cur.error(
                    f"unsupported tensor type: tensor {name!r} is {ggml_type} (ggml type id {type_id}); "
                    f"this reader supports {', '.join(f'{t} ({GGML_TYPE_IDS[t]})' for t in SUPPORTED_TYPES)}; "
                    f"the file's tensors are {tally}", start)
            if ggml_type in BLOCK_BYTES and shape[-1] % BLOCK_SIZE:
                raise cur.error(f"tensor {name!r} is {ggml_type} but its rows ({shape[-1]}) are not a "
                                f"multiple of the {BLOCK_SIZE}-weight block", start)
            nbytes = tensor_nbytes(shape, ggml_type)
            begin = self.data_offset + offset
            if begin + nbytes > size:
                raise cur.error(
                    f"tensor data out of bounds: {name!r} ({ggml_type}, {nbytes:,} bytes) starts at byte "
                    f"{begin:,} and would end at {begin + nbytes:,}, past the end of the file ({size:,} bytes)",
                    start)
            if name in self.tensors:
                raise cur.error(f"duplicate tensor name {name!r}", start)
            self.tensors[name] = TensorInfo(name, shape, ggml_type, begin, nbytes)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __repr__(self):
        return (f"GGUFFile({self.path.name!r}, version {self.version}, {len(self.metadata)} metadata keys, "
                f"{len(self.tensors)} tensors)")

    def tensor(self, name: str) -> np.ndarray | QMatrix:
        """The tensor's data: F32/F16 as zero-copy NumPy views, BF16 converted to float32,
        Q8_0/Q4_0/Q4_1 as a QMatrix over a zero-copy view of the packed bytes."""
        if name not in self.tensors:
            raise KeyError(f"{self.path.name} has no tensor named {name!r} ({len(self.tensors)} tensors, "
                           f"e.g. {', '.join(list(self.tensors)[:3])})")
        info = self.tensors[name]
        if info.ggml_type == "F32":
            return np.frombuffer(self._buf, "<f4", info.n_elements, info.offset).reshape(info.shape)
        if info.ggml_type == "F16":
            return np.frombuffer(self._buf, "<f2", info.n_elements, info.offset).reshape(info.shape)
        if info.ggml_type == "BF16":  # bf16 is the top half of an fp32
            top = np.frombuffer(self._buf, "<u2", info.n_elements, info.offset).astype(np.uint32)
            return (top << 16).view(np.float32).reshape(info.shape)
        rows, cols = int(np.prod(info.shape[:-1])), info.shape[-1]
        packed = np.frombuffer(self._buf, np.uint8, info.nbytes, info.offset).reshape(rows, -1)
        return QMatrix(info.ggml_type, (rows, cols), packed)  # data (rows, cols // 32 * block_bytes)


# -----------------------------------------------------------------------------------------------
# Writing

@dataclass(frozen=True)
class GGUFValue:
    """A metadata value with its GGUF type forced, where inference would pick another one:
    GGUFValue(7, "i32"), GGUFValue(0.5, "f64"), GGUFValue([1, 2], "u8") (element type for lists)."""

    value: Any
    type: str

    def __post_init__(self):
        if self.type not in SCALAR_DTYPES and self.type != "string":
            raise ValueError(f"unknown GGUF value type {self.type!r}; one of {', '.join([*SCALAR_DTYPES, 'string'])}")


_DTYPE_TO_VALUE_TYPE = {np.dtype(np.bool_): "bool", **{dt.newbyteorder("="): name for name, dt in SCALAR_DTYPES.items()
                                                      if name != "bool"}}


def _int_type(values) -> str:
    lo, hi = min(values), max(values)
    for name in ("u32", "i32", "u64", "i64") if lo >= 0 else ("i32", "i64"):
        info = np.iinfo(SCALAR_DTYPES[name])
        if info.min <= lo and hi <= info.max:
            return name
    raise ValueError(f"integer {lo if lo < 0 else hi} does not fit in 64 bits")


def _infer_scalar(value, key: str) -> str:
    if isinstance(value, (bool, np.bool_)):
        return "bool"
    if isinstance(value, str):
        return "string"
    if isinstance(value, np.generic) and value.dtype in _DTYPE_TO_VALUE_TYPE:
        return _DTYPE_TO_VALUE_TYPE[value.dtype]
    if isinstance(value, int):
        return _int_type([value])
    if isinstance(value, float):
        return "f32"
    raise ValueError(f"metadata {key!r}: cannot store a {type(value).__name__} in GGUF")


def _infer_elements(values: list, key: str) -> str:
    """The element type of a list: string, bool, integer (as fits), f32, or array (nested)."""
    if not values:
        raise ValueError(f"metadata {key!r}: an empty list has no element type; "
                         f"give one with GGUFValue([], 'string') (or 'i32', ...)")
    if all(isinstance(v, str) for v in values):
        return "string"
    if all(isinstance(v, (list, tuple, np.ndarray)) for v in values):
        return "array"
    if all(isinstance(v, (bool, np.bool_)) for v in values):
        return "bool"
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in values):
        i32 = np.iinfo(np.int32)
        return "i32" if i32.min <= min(values) and max(values) <= i32.max else "i64"
    if all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) for v in values):
        return "f32"
    raise ValueError(f"metadata {key!r}: a list must hold one kind of value (strings, numbers, bools or lists)")


def _u64(n: int) -> bytes:
    return int(n).to_bytes(8, "little")


def _u32(n: int) -> bytes:
    return int(n).to_bytes(4, "little")


def _encode_string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return _u64(len(raw)) + raw


def _encode_scalar(value, type_name: str, key: str) -> bytes:
    if type_name == "string":
        if not isinstance(value, str):
            raise ValueError(f"metadata {key!r}: {value!r} is not a string")
        return _encode_string(value)
    dtype = SCALAR_DTYPES[type_name]
    if dtype.kind in "iu" and not (np.iinfo(dtype).min <= value <= np.iinfo(dtype).max):
        raise ValueError(f"metadata {key!r}: {value} does not fit in {type_name}")
    return np.array(value, dtype=dtype).tobytes()


def _encode_array(values, element: str | None, key: str) -> bytes:
    """u32 element type, u64 count, then the elements (without their own type ids)."""
    if isinstance(values, np.ndarray) and element is None:
        if values.dtype.newbyteorder("=") not in _DTYPE_TO_VALUE_TYPE:
            raise ValueError(f"metadata {key!r}: cannot store a {values.dtype} array in GGUF")
        element = _DTYPE_TO_VALUE_TYPE[values.dtype.newbyteorder("=")]
    values = list(values) if not isinstance(values, np.ndarray) else values.reshape(-1)
    element = element or _infer_elements(values, key)
    head = _u32(VALUE_TYPE_IDS[element]) + _u64(len(values))
    if element == "string":
        return head + b"".join(_encode_scalar(v, "string", key) for v in values)
    if element == "array":
        return head + b"".join(_encode_array(v, None, key) for v in values)
    return head + np.asarray(values, dtype=SCALAR_DTYPES[element]).tobytes()


def _encode_entry(key: str, value) -> bytes:
    forced = value.type if isinstance(value, GGUFValue) else None
    value = value.value if isinstance(value, GGUFValue) else value
    if isinstance(value, (list, tuple, np.ndarray)):
        return _encode_string(key) + _u32(VALUE_TYPE_IDS["array"]) + _encode_array(value, forced, key)
    type_name = forced or _infer_scalar(value, key)
    return _encode_string(key) + _u32(VALUE_TYPE_IDS[type_name]) + _encode_scalar(value, type_name, key)


def _tensor_entry(name: str, tensor) -> tuple[tuple[int, ...], str, np.ndarray]:
    """A tensor to write -> (NumPy-order shape, ggml type, its bytes as a uint8 array)."""
    if isinstance(tensor, QMatrix):
        return tensor.shape, tensor.qtype, np.ascontiguousarray(tensor.data).reshape(-1)
    tensor = np.asarray(tensor)
    ggml_type = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}.get(tensor.dtype.newbyteorder("="))
    if ggml_type is None:
        raise ValueError(f"tensor {name!r} is {tensor.dtype}; write float32, float16 or a QMatrix")
    if not 1 <= tensor.ndim <= MAX_DIMS:
        raise ValueError(f"tensor {name!r} has {tensor.ndim} dimensions (1 to {MAX_DIMS} allowed)")
    data = np.ascontiguousarray(tensor, dtype=tensor.dtype.newbyteorder("<"))
    return tensor.shape, ggml_type, data.reshape(-1).view(np.uint8)


def write_gguf(path: str | os.PathLike, metadata: dict[str, Any], tensors: dict[str, np.ndarray | QMatrix],
               alignment: int = DEFAULT_ALIGNMENT) -> Path:
    """Write a GGUF v3 file. Metadata types are inferred - str -> string, bool -> bool, int -> u32
    (or i32/u64/i64, whichever fits first), float -> f32, list[str] -> string array, list of ints ->
    i32 array, list of floats -> f32 array, ndarray -> array of its dtype, list of lists -> nested
    arrays - or forced with GGUFValue(value, type). Tensors: float32 -> F32, float16 -> F16,
    QMatrix -> its block format; shapes in NumPy order."""
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a positive power of two, got {alignment}")
    metadata = dict(metadata)
    given = metadata.get("general.alignment")
    given = given.value if isinstance(given, GGUFValue) else given
    if given is not None and given != alignment:
        raise ValueError(f"metadata general.alignment = {given} disagrees with alignment = {alignment}")
    if alignment != DEFAULT_ALIGNMENT:
        metadata["general.alignment"] = GGUFValue(alignment, "u32")

    entries = [_tensor_entry(name, t) for name, t in tensors.items()]
    infos, offset = [], 0
    for name, (shape, ggml_type, data) in zip(tensors, entries):
        infos.append(_encode_string(name) + _u32(len(shape)) + b"".join(_u64(d) for d in reversed(shape))
                     + _u32(GGML_TYPE_IDS[ggml_type]) + _u64(offset))
        offset = -(-(offset + data.nbytes) // alignment) * alignment

    path = Path(path)
    with open(path, "wb") as f:
        f.write(GGUF_MAGIC + _u32(3) + _u64(len(tensors)) + _u64(len(metadata)))
        for key, value in metadata.items():
            f.write(_encode_entry(key, value))
        for info in infos:
            f.write(info)
        f.write(b"\0" * (-f.tell() % alignment))
        for _, _, data in entries:
            f.write(data.tobytes())
            f.write(b"\0" * (-f.tell() % alignment))
    return path
