"""Block-quantized weights: the Q8_0, Q4_0 and Q4_1 formats of GGUF, their quantizers, and the
NumPy reference that reads them - the specification every quantized kernel is tested against.

A quantized weight matrix is cut, along each row, into blocks of 32 weights. Each block stores a
float16 scale (and, for Q4_1, a float16 minimum) followed by 32 small integers:

    Q8_0  34 bytes = d (fp16) + 32 x int8 q                        w = q * d
    Q4_0  18 bytes = d (fp16) + 16 bytes of nibbles, q in 0..15    w = (q - 8) * d
    Q4_1  20 bytes = d (fp16) + m (fp16) + 16 bytes of nibbles     w = q * d + m

In the 4-bit formats, byte j of the nibbles holds weight j in its low 4 bits and weight j + 16 in
its high 4 bits (the two halves of the block, not neighbours).

`QMatrix` is the file format: the GGUF bytes as they are. fp16 scales convert to fp32 exactly.
A data format, below every kernel: this module imports none of them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# -----------------------------------------------------------------------------------------------
# The formats

BLOCK_SIZE = 32  # weights per block, in every format here
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
QTYPES = tuple(BLOCK_BYTES)


@dataclass(frozen=True, eq=False)
class QMatrix:
    """A (rows, cols) weight matrix in a block format; `data` holds the GGUF bytes, row-major.

    data: uint8 (rows, cols // 32 * block_bytes) - when read from a file, a zero-copy view of it.
    """

    qtype: str
    shape: tuple[int, int]
    data: np.ndarray

    def __post_init__(self):
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"unknown block format {self.qtype!r}; supported: {', '.join(QTYPES)}")
        rows, cols = self.shape
        if cols % BLOCK_SIZE:
            raise ValueError(f"{self.qtype} rows must be a multiple of {BLOCK_SIZE} long, got shape {self.shape}")
        expected = (rows, cols // BLOCK_SIZE * BLOCK_BYTES[self.qtype])
        if self.data.dtype != np.uint8 or self.data.shape != expected:
            raise ValueError(
                f"{self.qtype} data for shape {self.shape} must be uint8 {expected}, "
                f"got {self.data.dtype} {self.data.shape}"
            )
        object.__setattr__(self, "shape", (int(rows), int(cols)))

    @property
    def nbytes(self) -> int:
        """Packed bytes - what a matvec must read."""
        return self.data.nbytes

    @property
    def bits_per_weight(self) -> float:
        return 8 * BLOCK_BYTES[self.qtype] / BLOCK_SIZE

    def dequantize(self) -> np.ndarray:
        """(rows, cols) float32 by the NumPy reference below (bit-exact; the kernels import this
        module, so it calls none of them: kernels.cpu.quant.dequantize is the parallel one)."""
        return dequantize_reference(self)

    def __repr__(self):
        return f"QMatrix({self.qtype}, shape={self.shape}, {self.nbytes:,} bytes)"


# -----------------------------------------------------------------------------------------------
# Quantize: round-to-nearest, exactly as ggml's reference quantizers (ggml-quants.c) do it, all in
# float32 arithmetic, so our bytes equal llama.cpp's and the `gguf` package's.

def quantize(w: np.ndarray, qtype: str) -> QMatrix:
    """w (rows, cols) float32, cols % 32 == 0 -> QMatrix in `qtype`."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"quantize expects a 2-D (rows, cols) matrix, got shape {w.shape}")
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"unknown block format {qtype!r}; supported: {', '.join(QTYPES)}")
    rows, cols = w.shape
    if cols % BLOCK_SIZE:
        raise ValueError(f"quantize needs rows that are a multiple of {BLOCK_SIZE} long, got shape {w.shape}")
    blocks = w.astype(np.float32).reshape(-1, BLOCK_SIZE)  # (n_blocks, 32)
    packed = {"Q8_0": _quantize_q8_0, "Q4_0": _quantize_q4_0, "Q4_1": _quantize_q4_1}[qtype](blocks)
    return QMatrix(qtype, (rows, cols), packed.reshape(rows, -1))  # (rows, cols // 32 * block_bytes)


def _inverse(d: np.ndarray) -> np.ndarray:
    """1/d, and 0 where d == 0 (an all-zero block), in float32."""
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _fp16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8)  # (n_blocks, 2), round-to-nearest-even


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """q (n_blocks, 32) in 0..15 -> (n_blocks, 16): byte j = q[j] | q[j + 16] << 4."""
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def _quantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)  # (n_blocks, 1)
    scaled = blocks * _inverse(d)  # (n_blocks, 32) in [-127, 127]
    q = np.sign(scaled) * np.floor(np.abs(scaled) + np.float32(0.5))  # C roundf: halves away from 0
    return np.concatenate([_fp16_bytes(d), q.astype(np.int8).view(np.uint8)], axis=1)  # (n_blocks, 34)


def _quantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    # The scale carries the sign of the largest-magnitude weight, which lands exactly on q = 0.
    signed_max = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)  # (n_blocks, 1)
    d = signed_max / np.float32(-8)
    q = np.minimum(np.trunc(blocks * _inverse(d) + np.float32(8.5)), 15).astype(np.uint8)  # (n_blocks, 32)
    return np.concatenate([_fp16_bytes(d), _pack_nibbles(q)], axis=1)  # (n_blocks, 18)


def _quantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    lo = blocks.min(axis=1, keepdims=True)  # (n_blocks, 1)
    d = (blocks.max(axis=1, keepdims=True) - lo) / np.float32(15)
    q = np.minimum(np.trunc((blocks - lo) * _inverse(d) + np.float32(0.5)), 15).astype(np.uint8)  # (n_blocks, 32)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(lo), _pack_nibbles(q)], axis=1)  # (n_blocks, 20)


# -----------------------------------------------------------------------------------------------
# Dequantize, the reference: NumPy, one format per function, read it as the spec

def _blocks(data: np.ndarray, rows: int, cols: int, qtype: str) -> np.ndarray:
    n_blocks = rows * cols // BLOCK_SIZE
    return np.ascontiguousarray(data, dtype=np.uint8).reshape(n_blocks, BLOCK_BYTES[qtype])


def _fp16(two_bytes: np.ndarray) -> np.ndarray:
    """(n_blocks, 2) little-endian fp16 bytes -> (n_blocks, 1) float32 (exact)."""
    return np.ascontiguousarray(two_bytes).view(np.float16).astype(np.float32)


def _unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """(n_blocks, 16) bytes -> (n_blocks, 32) in 0..15: low nibbles are weights 0..15, high 16..31."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=1)


def dequantize_q8_0(data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Q8_0 bytes (rows, cols // 32 * 34) -> (rows, cols) float32."""
    blocks = _blocks(data, rows, cols, "Q8_0")  # (n_blocks, 34)
    d = _fp16(blocks[:, 0:2])  # (n_blocks, 1)
    q = blocks[:, 2:].view(np.int8).astype(np.float32)  # (n_blocks, 32)
    return (q * d).reshape(rows, cols)


def dequantize_q4_0(data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Q4_0 bytes (rows, cols // 32 * 18) -> (rows, cols) float32."""
    blocks = _blocks(data, rows, cols, "Q4_0")  # (n_blocks, 18)
    d = _fp16(blocks[:, 0:2])  # (n_blocks, 1)
    q = _unpack_nibbles(blocks[:, 2:]).astype(np.float32)  # (n_blocks, 32)
    return ((q - 8) * d).reshape(rows, cols)


def dequantize_q4_1(data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Q4_1 bytes (rows, cols // 32 * 20) -> (rows, cols) float32."""
    blocks = _blocks(data, rows, cols, "Q4_1")  # (n_blocks, 20)
    d = _fp16(blocks[:, 0:2])  # (n_blocks, 1)
    m = _fp16(blocks[:, 2:4])  # (n_blocks, 1)
    q = _unpack_nibbles(blocks[:, 4:]).astype(np.float32)  # (n_blocks, 32)
    return (q * d + m).reshape(rows, cols)


_DEQUANTIZE_REFERENCE = {"Q8_0": dequantize_q8_0, "Q4_0": dequantize_q4_0, "Q4_1": dequantize_q4_1}


def dequantize_reference(qm: QMatrix) -> np.ndarray:
    """QMatrix -> (rows, cols) float32, in NumPy."""
    rows, cols = qm.shape
    return _DEQUANTIZE_REFERENCE[qm.qtype](qm.data, rows, cols)
