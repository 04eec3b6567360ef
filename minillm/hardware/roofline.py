"""The roofline model, and the four numbers that decide an LLM's decode speed.

A kernel that does F floating-point operations while moving B bytes has arithmetic intensity
I = F / B (FLOP/byte). It cannot run faster than the processor computes (peak P FLOP/s) nor faster
than memory feeds it (I x W FLOP/s for bandwidth W), so

    attainable FLOP/s = min(P, I x W)

On a log-log plot that is a slanted line (memory-bound) meeting a flat one (compute-bound) at the
ridge point I = P / W. Each memory level (L1, L2, L3, DRAM) has its own bandwidth, so its own
slanted roof; a kernel's working set decides which one applies.

Decoding one token of an N-parameter model with B bytes per weight, for a batch of b sequences,
reads every weight once (N x B bytes) and does 2 x N x b FLOP (a multiply and an add per weight per
sequence): intensity 2b / B, far left of any ridge point at batch 1. Four numbers follow:
capacity (N x B bytes must fit in memory), compute time per step (2 N b / P), memory time per step
(N B / W), and the decode ceiling (b x W / (N B) tokens per second).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minillm.hardware.devices import DeviceSpec


# ----------------------------------------------------------------------------------------------
# Pure functions: the arithmetic of the roofline and of decoding

def attainable_flops(intensity_flop_per_byte, peak_flops, bandwidth_bytes_per_s):
    """min(peak, intensity x bandwidth): the best FLOP/s a kernel of this intensity can reach.

    Works on scalars and NumPy arrays alike (to draw a roof, pass an array of intensities).
    """
    intensity = np.asarray(intensity_flop_per_byte, dtype=np.float64)
    if np.any(intensity < 0):
        raise ValueError("arithmetic intensity must be >= 0 FLOP/byte")
    if peak_flops <= 0 or bandwidth_bytes_per_s <= 0:
        raise ValueError(f"peak_flops and bandwidth_bytes_per_s must be > 0, got {peak_flops} and "
                         f"{bandwidth_bytes_per_s}")
    return np.minimum(peak_flops, intensity * bandwidth_bytes_per_s)


def ridge_point(peak_flops: float, bandwidth_bytes_per_s: float) -> float:
    """Intensity (FLOP/byte) where the memory roof meets the compute roof: below it, memory-bound."""
    return peak_flops / bandwidth_bytes_per_s


def weight_bytes(n_params: float, bytes_per_weight: float) -> float:
    """Capacity: bytes the weights occupy, hence bytes read per decode step."""
    _check_positive(n_params=n_params, bytes_per_weight=bytes_per_weight)
    return n_params * bytes_per_weight


def compute_time_per_step_s(n_params: float, peak_flops: float, batch: int = 1) -> float:
    """2 N b / P: seconds of arithmetic per decode step (b tokens, one per sequence)."""
    _check_positive(n_params=n_params, peak_flops=peak_flops, batch=batch)
    return 2 * n_params * batch / peak_flops


def memory_time_per_step_s(n_params: float, bytes_per_weight: float, bandwidth_bytes_per_s: float) -> float:
    """N B / W: seconds to stream every weight once. The same for any batch: weights are shared."""
    _check_positive(bandwidth_bytes_per_s=bandwidth_bytes_per_s)
    return weight_bytes(n_params, bytes_per_weight) / bandwidth_bytes_per_s


def decode_ceiling_tokens_per_s(n_params, bytes_per_weight, bandwidth_bytes_per_s, batch=1):
    """b x W / (N B): tokens per second if each step only had to read the weights once.

    Every step reads all N x B bytes of weights and produces one token for each of the ``batch``
    sequences. Memory-bound decode can go no faster; real engines reach a fraction of it.
    """
    _check_positive(n_params=n_params, bytes_per_weight=bytes_per_weight,
                    bandwidth_bytes_per_s=bandwidth_bytes_per_s, batch=batch)
    return batch * bandwidth_bytes_per_s / (n_params * bytes_per_weight)


def decode_intensity_flop_per_byte(bytes_per_weight: float, batch: int = 1) -> float:
    """2 b / B: FLOP per byte of weights in a decode step (2 N b FLOP over N B bytes)."""
    _check_positive(bytes_per_weight=bytes_per_weight, batch=batch)
    return 2 * batch / bytes_per_weight


@dataclass(frozen=True)
class FourNumbers:
    weight_bytes: float                 # capacity needed for the weights
    compute_s_per_step: float           # 2 N b / P
    memory_s_per_step: float            # N B / W
    decode_ceiling_tokens_per_s: float  # b W / (N B)

    @property
    def memory_over_compute(self) -> float:
        """How many times longer reading the weights takes than the arithmetic."""
        return self.memory_s_per_step / self.compute_s_per_step


def four_numbers(n_params: float, bytes_per_weight: float, peak_flops: float,
                 bandwidth_bytes_per_s: float, batch: int = 1) -> FourNumbers:
    """The four numbers of decoding this model on this device."""
    return FourNumbers(
        weight_bytes=weight_bytes(n_params, bytes_per_weight),
        compute_s_per_step=compute_time_per_step_s(n_params, peak_flops, batch),
        memory_s_per_step=memory_time_per_step_s(n_params, bytes_per_weight, bandwidth_bytes_per_s),
        decode_ceiling_tokens_per_s=decode_ceiling_tokens_per_s(n_params, bytes_per_weight,
                                                                bandwidth_bytes_per_s, batch),
    )


@dataclass(frozen=True)
class DecodeStep:
    """One decode step of ``batch`` sequences, bounded by the roofline: max(bytes / W, FLOP / P)."""

    batch: int
    bytes_moved: float    # weights once + each sequence's own state (its KV cache)
    flops: float          # 2 N per sequence + each sequence's attention over its context
    seconds: float        # the bound: the slower of moving the bytes and doing the FLOP
    bound: str            # "memory" | "compute"

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes_moved

    @property
    def achieved_flops(self) -> float:
        """FLOP/s at the bound: where the step sits under its roof."""
        return self.flops / self.seconds

    @property
    def tokens_per_s(self) -> float:
        """Throughput of the whole batch: one token per sequence per step."""
        return self.batch / self.seconds


def decode_step(weight_bytes: float, flops_per_token: float, peak_flops: float, bandwidth_bytes_per_s: float,
                batch: int = 1, state_bytes_per_seq: float = 0.0, state_flops_per_seq: float = 0.0) -> DecodeStep:
    """The roofline bound on one decode step that advances ``batch`` sequences by a token each.

    The weights are read once and shared by the batch; every sequence reads its own state (its KV
    cache: ``state_bytes_per_seq``) and does its own attention over it (``state_flops_per_seq``).
    With no state this is the four numbers' step, max(N B / W, 2 N b / P).
    """
    _check_positive(weight_bytes=weight_bytes, flops_per_token=flops_per_token, peak_flops=peak_flops,
                    bandwidth_bytes_per_s=bandwidth_bytes_per_s, batch=batch)
    if state_bytes_per_seq < 0 or state_flops_per_seq < 0:
        raise ValueError(f"state_bytes_per_seq and state_flops_per_seq must be >= 0, got "
                         f"{state_bytes_per_seq} and {state_flops_per_seq}")
    bytes_moved = weight_bytes + batch * state_bytes_per_seq
    flops = batch * (flops_per_token + state_flops_per_seq)
    memory_s, compute_s = bytes_moved / bandwidth_bytes_per_s, flops / peak_flops
    return DecodeStep(batch, bytes_moved, flops, max(memory_s, compute_s),
                      "memory" if memory_s >= compute_s else "compute")


def _check_positive(**values):
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


# ----------------------------------------------------------------------------------------------
# The roofline of one machine, and its plot

@dataclass(frozen=True)
class RooflinePoint:
    """A kernel placed on the roofline: its intensity and the FLOP/s it achieved (or could)."""

    label: str
    intensity: float     # FLOP/byte
    flops: float         # FLOP/s


@dataclass(frozen=True)
class Roofline:
    """Measured (or data-sheet) ceilings: peak FLOP/s and one bandwidth per memory level."""

    peak_flops: float
    bandwidths: dict[str, float]    # level -> bytes/s, L1 first, main memory last: {"L1": ..., "DRAM": ...}
    name: str = "this machine"

    def __post_init__(self):
        if not self.bandwidths:
            raise ValueError("a roofline needs at least one memory bandwidth")
        _check_positive(peak_flops=self.peak_flops, **self.bandwidths)

    @classmethod
    def measured(cls, peak_gflops: float, bandwidth_gbs: dict[str, float], name: str = "this machine") -> Roofline:
        """From microbenchmark figures in GFLOP/s and GB/s (per level), as `minillm hw` prints them."""
        return cls(peak_gflops * 1e9, {level: gbs * 1e9 for level, gbs in bandwidth_gbs.items()}, name)

    @classmethod
    def of_device(cls, device: DeviceSpec, precision: str = "bf16") -> Roofline:
        """A data-sheet roofline: one precision's dense peak over the HBM bandwidth."""
        return cls(device.peak(precision), {"HBM": device.bandwidth_bytes_per_s}, f"{device.name}, {precision}")

    @property
    def main_memory(self) -> str:
        """The last level, where data that fits in no cache (a model's weights) comes from."""
        return list(self.bandwidths)[-1]

    def attainable(self, intensity_flop_per_byte, level: str | None = None):
        """Attainable FLOP/s against ``level``'s bandwidth (default: main memory)."""
        return attainable_flops(intensity_flop_per_byte, self.peak_flops, self._bandwidth(level))

    def ridge_point(self, level: str | None = None) -> float:
        return ridge_point(self.peak_flops, self._bandwidth(level))

    def plot(self, ax=None, points: list[RooflinePoint] = (), intensity_range: tuple[float, float] | None = None):
        """Log-log roofline: one roof per memory level, the compute ceiling, and labelled points."""
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(7, 4.5))
        ridges = [self.ridge_point(level) for level in self.bandwidths]
        lo, hi = intensity_range or (min([1 / 16, *[p.intensity / 2 for p in points]]),
                                     max([4 * max(ridges), *[p.intensity * 2 for p in points]]))
        intensity = np.geomspace(lo, hi, 256)                                      # (256,)
        for level, bandwidth in self.bandwidths.items():
            ax.loglog(intensity, self.attainable(intensity, level), lw=2,
                      label=f"{level}: {bandwidth / 1e9:,.0f} GB/s")
        ax.axhline(self.peak_flops, color="black", ls="--", lw=1,
                   label=f"peak: {self.peak_flops / 1e9:,.0f} GFLOP/s")
        for point in points:
            ax.plot(point.intensity, point.flops, "o", color="crimson")
            ax.annotate(point.label, (point.intensity, point.flops), textcoords="offset points",
                        xytext=(6, -12), fontsize=9)
        ax.set_xlabel("arithmetic intensity (FLOP/byte)")
        ax.set_ylabel("attainable FLOP/s")
        ax.set_title(f"Roofline: {self.name}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        return ax

    def _bandwidth(self, level: str | None) -> float:
        level = level or self.main_memory
        if level not in self.bandwidths:
            raise ValueError(f"unknown memory level {level!r}; this roofline has {list(self.bandwidths)}")
        return self.bandwidths[level]


def plot_rooflines(rooflines: dict[str, tuple[Roofline, list[RooflinePoint]]], ax=None,
                   intensity_range: tuple[float, float] = (1 / 8, 4096)):
    """Several machines on one log-log plot: each one's main-memory roof, its ridge and its points.

    ``rooflines`` maps a legend label to (roofline, points on it); each machine gets one colour, so
    a point reads against its own roof. Only the main memory is drawn: it is where weights live.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 5))
    intensity = np.geomspace(*intensity_range, 256)                                 # (256,)
    for color, (label, (roof, points)) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], rooflines.items()):
        ridge = roof.ridge_point()
        ax.loglog(intensity, roof.attainable(intensity), color=color, lw=2,
                  label=f"{label}: ridge {ridge:,.1f} FLOP/byte")
        ax.plot(ridge, roof.peak_flops, "|", color=color, ms=14, mew=2)
        ax.plot([p.intensity for p in points], [p.flops for p in points], "o", color=color, ms=5)
        for point in points:
            ax.annotate(point.label, (point.intensity, point.flops), textcoords="offset points",
                        xytext=(4, -11), fontsize=7, color=color)
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("attainable FLOP/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    return ax
