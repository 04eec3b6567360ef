"""Accelerators from their data sheets: the one home of every published GPU figure in the course.

Each figure is the vendor's, for the SXM (socketed, full-power) board:

- peak FLOP/s are **dense** (NVIDIA's headline tensor-core figures assume 2:4 structured sparsity
  and are twice these; dense is what an LLM's weight matrices run at);
- FP32 is the plain CUDA-core rate; BF16, FP16 and INT8 are tensor-core rates;
- memory is the board's HBM as the data sheet states it ("80 GB"), of which the driver, the CUDA
  context and library workspaces take a little before a model gets any.

Sources: NVIDIA A100 Tensor Core GPU data sheet and Ampere architecture white paper (A100 80GB SXM4:
19.5 TFLOP/s FP32, 312 TFLOP/s BF16/FP16, 624 TOPS INT8, 2,039 GB/s HBM2e); NVIDIA H100 Tensor
Core GPU data sheet and Hopper architecture white paper (H100 SXM5: 66.9 TFLOP/s FP32, 989.4
TFLOP/s BF16/FP16, 1,978.9 TOPS INT8, 3.35 TB/s HBM3).
"""
from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = ("fp32", "bf16", "fp16", "int8")


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: float             # HBM capacity
    bandwidth_bytes_per_s: float    # HBM bandwidth
    peak_fp32: float                # FLOP/s, CUDA cores
    peak_bf16: float                # FLOP/s, tensor cores, dense
    peak_fp16: float                # FLOP/s, tensor cores, dense
    peak_int8: float                # OP/s, tensor cores, dense

    def __post_init__(self):
        for field in ("memory_bytes", "bandwidth_bytes_per_s", *(f"peak_{p}" for p in PRECISIONS)):
            if not getattr(self, field) > 0:
                raise ValueError(f"DeviceSpec.{field} must be > 0, got {getattr(self, field)!r}")

    @property
    def peak_flops(self) -> float:
        """Dense BF16: the rate an LLM's matrix products run at on these chips."""
        return self.peak_bf16

    def peak(self, precision: str) -> float:
        """Dense peak FLOP/s (OP/s for int8) of one precision: "fp32", "bf16", "fp16" or "int8"."""
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; a DeviceSpec has {', '.join(PRECISIONS)}")
        return getattr(self, f"peak_{precision}")

    def ridge_point(self, precision: str = "bf16") -> float:
        """FLOP per byte of HBM traffic above which a kernel at this precision is compute-bound."""
        return self.peak(precision) / self.bandwidth_bytes_per_s


A100_SXM_80GB = DeviceSpec("NVIDIA A100 80GB SXM (HBM2e)", memory_bytes=80e9, bandwidth_bytes_per_s=2.039e12,
                           peak_fp32=19.5e12, peak_bf16=312e12, peak_fp16=312e12, peak_int8=624e12)

H100_SXM = DeviceSpec("NVIDIA H100 SXM (HBM3)", memory_bytes=80e9, bandwidth_bytes_per_s=3.35e12,
                      peak_fp32=66.9e12, peak_bf16=989.4e12, peak_fp16=989.4e12, peak_int8=1978.9e12)

DEVICES = {"A100": A100_SXM_80GB, "H100": H100_SXM}


# -----------------------------------------------------------------------------------------------
# Interconnects between GPUs: what a tensor-parallel all-reduce crosses.
#
# Vendor data sheet figures, which count both directions at once ("bidirectional"); a ring
# all-reduce sends and receives at the same time on every rank, so the rate one rank's sends see is
# half of it, the per-direction figure. Sources: NVIDIA A100 data sheet (NVLink 3rd generation,
# 600 GB/s per GPU; PCIe Gen4 x16, 64 GB/s); NVIDIA H100 data sheet (NVLink 4th generation,
# 900 GB/s per GPU; PCIe Gen5 x16, 128 GB/s). Data sheets give no latency: an all-reduce's alpha
# comes from measurement (nccl-tests on the machine), not from here.

@dataclass(frozen=True)
class InterconnectSpec:
    name: str
    bidirectional_bytes_per_s: float    # the data sheet's figure, both directions summed

    def __post_init__(self):
        if not self.bidirectional_bytes_per_s > 0:
            raise ValueError(f"InterconnectSpec.bidirectional_bytes_per_s must be > 0, got {self.bidirectional_bytes_per_s!r}")

    @property
    def bytes_per_s_per_direction(self) -> float:
        return self.bidirectional_bytes_per_s / 2


NVLINK3_A100 = InterconnectSpec("NVLink 3 (A100 SXM)", bidirectional_bytes_per_s=600e9)
NVLINK4_H100 = InterconnectSpec("NVLink 4 (H100 SXM)", bidirectional_bytes_per_s=900e9)
PCIE4_X16 = InterconnectSpec("PCIe 4.0 x16", bidirectional_bytes_per_s=64e9)
PCIE5_X16 = InterconnectSpec("PCIe 5.0 x16", bidirectional_bytes_per_s=128e9)

INTERCONNECTS = {"NVLink 3": NVLINK3_A100, "NVLink 4": NVLINK4_H100, "PCIe 4.0 x16": PCIE4_X16,
                 "PCIe 5.0 x16": PCIE5_X16}
