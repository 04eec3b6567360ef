"""Runtime repacking: a QMatrix rearranged once, at load time, into the layout the SIMD kernels read.

The GGUF layout interleaves a block's fp16 scale, its minimum and its codes, row after row: a kernel
must decode the fp16 scales and can feed each activation load to one row only. ``repack`` splits
them apart (what llama.cpp calls "runtime repacking"):

    quants  uint8 (groups, blocks, R, 16 | 32)  the codes of R rows, block by block: for block b,
                                                the codes of its R rows lie side by side, so one
                                                activation block serves R rows from registers;
                                                4-bit codes keep GGUF's order (byte j = weight j
                                                low, weight j + 16 high: one mask and one shift
                                                make two whole vectors of lanes)
    scales  float32 (groups, blocks, R)         d, converted from fp16 once (exactly)
    mins    float32 (groups, blocks, R)         Q4_1: m;  Q4_0: -8 d, so that w = d q + m for both
                                                (exact: (q - 8) d has at most 15 significant bits)

Rows are padded with zero blocks to a multiple of R; the kernels' padded outputs are cut off.
R (``ROWS_PER_GROUP``) follows the target's registers: each row holds one accumulator of 16 fp32
lanes, which is one AVX-512 register of 32 or two AVX2 registers of 16.

Codes for the int8 kernel (``chunked``) lie otherwise: a block's R rows are interleaved in chunks
of 4 bytes, so that each 32-bit lane of a vector holds one row's codes:

    quants  uint8 (groups, blocks, 4, R, 4)     [g, b, k, r, i] = GGUF code byte 4k + i of row r in
                                                block b: its low nibbles are weights 4k..4k+3, its
                                                high ones 16 + 4k..16 + 4k + 3
            uint8 (groups, blocks, 8, R, 4)     Q8_0: [g, b, k, r, i] = q + 128 for weight 4k + i
                                                (unsigned, as vpdpbusd multiplies them; the kernel
                                                takes -128 d as the minimum)

One integer dot-product instruction then takes 4 weights of each of 16 (AVX-512) or 8 (AVX2) rows
against 4 activation codes broadcast to every lane, and a lane ends the block holding its row's
whole sum: no horizontal sums and no shuffles (what llama.cpp's repacked Q4_0 "8x8" layouts do).
R is then a multiple of those lanes (``INT8_ROWS_PER_GROUP``). Their scales and minimums stay
fp16 (``uint16`` arrays of the bits, as Numba has no float16 type), so that a block costs the GGUF
file's bytes (20 for Q4_1, 34 for Q8_0) instead of 24 or 36: decode streams the layers from DRAM,
and this kernel is fast enough to wait on it. One instruction widens 16 of them (where the target
has one: ``HALF_SCALES``).

``RepackedMatrix`` is a ``QMatrix`` (the GGUF bytes stay, for the reference backend, the
embedding lookup and the batched kernel) that also carries the repacked arrays and the activation
mode ("fp32": exact; "int8": activations quantized per block, integer dot products).
"""
from __future__ import annotations

import platform
from dataclasses import dataclass

import numpy as np

from minillm.hardware.machine import compile_target
from minillm.kernels.quant_formats import BLOCK_BYTES, BLOCK_SIZE, QMatrix

# 8 rows x 1 zmm accumulator on AVX-512 (of 32 registers), 4 rows x 2 ymm on AVX2 (of 16): the
# rest hold the activation block and the unpacked codes (AVX2 at R = 4 already spills two). R
# matters less than the register count suggests: one thread, Q4_1 1536 x 576 in cache, exact mode,
# AVX2 R = 2 / 4 / 8: 93 / 90 / 84 us; AVX-512 R = 4 / 8: 65 / 66 us (noisy shared machine).
# The AVX-512 int8 kernel needs R even (it puts two rows in one register).
ROWS_PER_GROUP = 8 if compile_target().vector_bits == 512 else 4
INT8_ROWS_PER_GROUP = 16 if compile_target().vector_bits == 512 else 8  # rows a vector of int32 lanes holds
# fp16 scales for the chunked layout where the target widens fp16 in hardware (quant_llvm.widen_half):
# every AVX2 or AVX-512 x86 CPU (F16C) and AArch64; older x86 targets keep float32
HALF_SCALES = platform.machine() in ("arm64", "aarch64") or compile_target().vector_bits >= 256
ACTIVATIONS = ("fp32", "int8")
CODE_BYTES = {"Q8_0": 32, "Q4_0": 16, "Q4_1": 16}  # bytes of codes per block (the rest: d, m)


@dataclass(frozen=True, eq=False)
class RepackedMatrix(QMatrix):
    """A QMatrix plus its SIMD layout (see the module docstring); ``rows_per_group`` is R."""

    quants: np.ndarray       # uint8 (groups * blocks * R * code bytes,)
    scales: np.ndarray       # float32 (groups * blocks * R,); chunked: uint16 fp16 bits (HALF_SCALES)
    mins: np.ndarray         # as scales; empty for Q8_0
    rows_per_group: int
    activations: str

    def __post_init__(self):
        super().__post_init__()
        check_activations(self.activations)

    @property
    def chunked(self) -> bool:
        """Whether the codes lie in 4-byte chunks of R rows (int8 activations)."""
        return self.activations == "int8"

    @property
    def groups(self) -> int:
        return -(-self.shape[0] // self.rows_per_group)

    def __repr__(self):
        return (f"RepackedMatrix({self.qtype}, shape={self.shape}, {self.rows_per_group} rows a group, "
                f"activations={self.activations})")


def check_activations(activations: str) -> None:
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(map(repr, ACTIVATIONS))}, got {activations!r}")


def _fp16_field(blocks: np.ndarray, at: int) -> np.ndarray:
    """(rows, blocks, block bytes) uint8 -> (rows, blocks) float32 from the fp16 at byte ``at``."""
    return np.ascontiguousarray(blocks[:, :, at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _group_major(a: np.ndarray, rows_per_group: int) -> np.ndarray:
    """(padded rows, blocks, ...) -> flat, ordered (groups, blocks, R, ...)."""
    padded_rows, n_blocks = a.shape[:2]
    grouped = a.reshape(padded_rows // rows_per_group, rows_per_group, n_blocks, *a.shape[2:])
    return np.ascontiguousarray(np.swapaxes(grouped, 1, 2)).reshape(-1)


def repack(qm: QMatrix, activations: str = "fp32", rows_per_group: int | None = None) -> RepackedMatrix:
    """The SIMD layout of ``qm``, for the fp32 ("exact") or int8 activation kernels; R this target's
    for the mode unless given."""
    check_activations(activations)
    if isinstance(qm, RepackedMatrix):
        qm = QMatrix(qm.qtype, qm.shape, qm.data)
    if rows_per_group is None:
        rows_per_group = INT8_ROWS_PER_GROUP if activations == "int8" else ROWS_PER_GROUP
    chunked = activations == "int8"
    rows, cols = qm.shape
    n_blocks = cols // BLOCK_SIZE
    padded = -(-rows // rows_per_group) * rows_per_group
    blocks = np.zeros((padded, n_blocks, BLOCK_BYTES[qm.qtype]), dtype=np.uint8)  # (padded, blocks, bytes)
    blocks[:rows] = qm.data.reshape(rows, n_blocks, -1)
    d = _fp16_field(blocks, 0)  # (padded, blocks)
    if qm.qtype == "Q8_0":
        mins = np.empty(0, dtype=np.float32)
    else:
        mins = _group_major(_fp16_field(blocks, 2) if qm.qtype == "Q4_1" else d * np.float32(-8), rows_per_group)
    codes = blocks[:, :, -CODE_BYTES[qm.qtype]:]  # (padded, blocks, code bytes)
    quants, scales = _group_major(codes, rows_per_group), _group_major(d, rows_per_group)  # (groups, blocks, R, ...)
    if chunked:  # (groups * blocks, R, chunks, 4) -> (groups * blocks, chunks, R, 4)
        if qm.qtype == "Q8_0":  # q + 128: the unsigned bytes vpdpbusd multiplies (-128 d is the minimum)
            quants = quants ^ np.uint8(0x80)
        n_chunks = CODE_BYTES[qm.qtype] // 4
        quants = np.ascontiguousarray(quants.reshape(-1, rows_per_group, n_chunks, 4).swapaxes(1, 2)).reshape(-1)
        if HALF_SCALES:  # back to the file's fp16 (exact: they came from there; -8 d only moves the exponent)
            scales, mins = (a.astype(np.float16).view(np.uint16) for a in (scales, mins))
    return RepackedMatrix(qm.qtype, qm.shape, qm.data, quants=quants, scales=scales, mins=mins,
                          rows_per_group=rows_per_group, activations=activations)
