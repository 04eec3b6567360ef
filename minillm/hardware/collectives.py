"""What communication costs: an all-reduce microbenchmark on torch.distributed, the alpha-beta model
fitted to it, and the bytes a token costs under tensor parallelism.

The alpha-beta model says one collective of n bytes takes t(n) = alpha + n / beta: a fixed latency
alpha (start the operation, cross the wire once, synchronise the ranks) plus the bytes at a
bandwidth beta. Small messages are all alpha, large ones all beta; a decode step of tensor
parallelism sends small messages, so its cost is mostly alpha times the number of all-reduces.

torch is imported inside the functions that need it, so ``import minillm`` never loads it.
The ranks are processes on 127.0.0.1: on a CPU the "interconnect" is shared memory through the
loopback network stack (gloo), not a wire; on a GPU machine backend="nccl" measures NVLink or PCIe.
"""
from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass

import numpy as np

FP32_BYTES = 4
DEFAULT_SIZES = tuple(4 * 4**k for k in range(12))  # 4 B, 16 B, ..., 4 MiB, 16 MiB: one fp32 to 4 Mi of them


@dataclass(frozen=True)
class AlphaBeta:
    alpha_s: float                  # fixed latency of one collective, seconds
    beta_bytes_per_s: float         # bandwidth the message size sees, bytes/s

    def seconds(self, message_bytes: float) -> float:
        return self.alpha_s + message_bytes / self.beta_bytes_per_s


def fit_alpha_beta(message_bytes, seconds) -> AlphaBeta:
    """Least-squares fit of t(n) = alpha + n / beta to measured (n, t) points, in relative error.

    Why relative: the times span four orders of magnitude, and plain least squares would let the
    largest messages' microseconds of noise swamp the small messages, which are the ones that show
    alpha. Dividing each row by its t makes every point count by its percentage miss.
    """
    n = np.asarray(message_bytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if n.shape != t.shape or n.ndim != 1 or len(n) < 2:
        raise ValueError(f"need two equal-length 1-D sequences of at least 2 points, got shapes {n.shape}, {t.shape}")
    if len(np.unique(n)) < 2:
        raise ValueError("need at least two distinct message sizes to separate alpha from beta")
    if not (np.all(n > 0) and np.all(t > 0)):
        raise ValueError("message sizes and times must be positive")
    design = np.stack([np.ones_like(n), n], axis=1) / t[:, None]  # (points, 2): [1, n] @ [alpha, 1/beta], per t
    (alpha, inverse_beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if inverse_beta <= 0:
        raise ValueError(f"the fitted time does not grow with the message size (slope {inverse_beta:.3g} s/B): "
                         "too few or too noisy points")
    return AlphaBeta(alpha_s=float(alpha), beta_bytes_per_s=float(1.0 / inverse_beta))


# -----------------------------------------------------------------------------------------------
# the bytes a token costs under tensor parallelism

def ring_allreduce_bytes_per_rank(message_bytes: float, world_size: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce: a reduce-scatter then an
    all-gather, each moving (N-1)/N of the message, so 2(N-1)/N of it in all."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return 2 * (world_size - 1) / world_size * message_bytes


@dataclass(frozen=True)
class TokenCommunication:
    allreduces_per_step: int        # 2 per layer: after attention's O and after the FFN's down
    message_bytes: float            # one all-reduce's message: tokens * D * bytes per value
    bytes_per_rank_per_step: float  # what each rank sends in a ring, all layers
    seconds_per_step: float         # under the alpha-beta model given


def tp_communication(hidden_size: int, n_layers: int, world_size: int, link: AlphaBeta,
                     tokens: int = 1, value_bytes: int = FP32_BYTES) -> TokenCommunication:
    """The all-reduces of one forward over `tokens` tokens with Megatron-style tensor parallelism:
    each layer all-reduces the attention output and the FFN output, D values per token each.

    Time per all-reduce: 2(N-1) ring hops each paying alpha would be the pessimist's count; we use
    the measured alpha of a whole all-reduce as one, plus the ring's bytes per rank over beta, so
    a link fitted on this machine's all-reduces is used as measured.
    """
    for name, value in (("hidden_size", hidden_size), ("n_layers", n_layers), ("world_size", world_size),
                        ("tokens", tokens), ("value_bytes", value_bytes)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    count = 2 * n_layers
    message = tokens * hidden_size * value_bytes
    per_rank = ring_allreduce_bytes_per_rank(message, world_size)
    seconds = 0.0 if world_size == 1 else count * (link.alpha_s + per_rank / link.beta_bytes_per_s)
    return TokenCommunication(count, message, count * per_rank, seconds)


# -----------------------------------------------------------------------------------------------
# the microbenchmark

def free_port() -> int:
    """A TCP port on 127.0.0.1 that no one listens on now (the OS picks it), for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, backend: str, sizes: tuple[int, ...], repeats: int,
               calls_per_sample: int, check: list | None, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # a rank is one core's worth: the collective, not a thread pool, is measured
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    try:
        result = {}
        if check is not None:  # the correctness probe: each rank contributes its own row
            tensor = torch.tensor(check[rank], dtype=torch.float32, device=device)
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            result["check"] = tensor.cpu().numpy()
        buffers = {n: torch.ones(max(1, n // FP32_BYTES), dtype=torch.float32, device=device) for n in sizes}
        times = {n: [] for n in sizes}
        for n in sizes:  # warm-up: the first call on a size sets up buffers and connections
            dist.all_reduce(buffers[n])
        for _ in range(repeats):  # interleaved: a slow moment of the machine hits every size alike
            for n in sizes:
                dist.barrier()
                if backend == "nccl":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(calls_per_sample):
                    dist.all_reduce(buffers[n])
                if backend == "nccl":
                    torch.cuda.synchronize()
                times[n].append((time.perf_counter() - start) / calls_per_sample)
        result["times"] = times
        np.save(os.path.join(out_dir, f"rank{rank}.npy"), np.array(result, dtype=object), allow_pickle=True)
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class AllReduceSweep:
    backend: str
    world_size: int
    message_bytes: list[int]
    median_seconds: list[float]     # per size: median over repeats of the slowest rank's time
    fit: AlphaBeta
    check: np.ndarray | None        # the all-reduced probe as rank 0 saw it


def allreduce_sweep(world_size: int = 2, backend: str = "gloo", sizes=DEFAULT_SIZES, repeats: int = 5,
                    calls_per_sample: int = 10, check=None) -> AllReduceSweep:
    """Time all-reduce (sum, fp32) over message sizes in `world_size` processes on this machine.

    Each sample times `calls_per_sample` back-to-back all-reduces after a barrier, per rank; a size's
    time in a repeat is the slowest rank's (an all-reduce is done when the last rank is done), and
    its figure the median over repeats. `check`, if given, is a (world_size, k) array: rank r
    all-reduces row r first, and the result comes back for comparison with check.sum(axis=0).
    """
    import torch.multiprocessing as mp

    if world_size < 2:
        raise ValueError(f"an all-reduce needs world_size >= 2, got {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' (CPU) or 'nccl' (GPU), got {backend!r}")
    sizes = tuple(sorted({int(n) for n in sizes}))
    if not sizes or sizes[0] < FP32_BYTES or any(n % FP32_BYTES for n in sizes):
        raise ValueError(f"message sizes must be positive multiples of {FP32_BYTES} bytes (fp32), got {sizes}")
    if check is not None:
        check = np.asarray(check, dtype=np.float32)
        if check.ndim != 2 or check.shape[0] != world_size:
            raise ValueError(f"check must have shape (world_size={world_size}, k), got {check.shape}")
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank_main, nprocs=world_size, join=True,
                 args=(world_size, free_port(), backend, sizes, repeats, calls_per_sample,
                       None if check is None else check.tolist(), out_dir))
        results = [np.load(os.path.join(out_dir, f"rank{r}.npy"), allow_pickle=True).item() for r in range(world_size)]
    medians = [statistics.median(max(r["times"][n][i] for r in results) for i in range(repeats)) for n in sizes]
    return AllReduceSweep(backend, world_size, list(sizes), medians, fit_alpha_beta(sizes, medians),
                          results[0].get("check"))
