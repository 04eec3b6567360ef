"""Tensor parallelism on torch.distributed: N ranks, each running the one forward on its shard.

    rank 0 (the engine's process)                   ranks 1 .. N-1 (spawned processes)
    scheduler, block manager, sampler
    each forward: broadcast the plan           ->   copy-on-write copies, token ids, block tables, depth
    forward on its shard                            forward on its shard
      all-reduce the embedding, after O and down <-> the same collectives, in the same order
      gather the vocabulary slices of the logits <-  its slice
    sample from the full logits

Every rank keeps a paged KV cache for its own KV heads, with the same blocks as rank 0's block
manager hands out, so the plan - block tables and slot mapping - is the only state that travels.
Every forward of the engine goes through its model runner, the early-exit drafter's too (with the
number of layers to run), so speculative decoding runs on the group like plain decoding.
The collectives are gloo's (the CPU backend; GPU ranks would use NCCL with device tensors); their
tensors are the NumPy arrays themselves (``torch.from_numpy`` shares the memory, and all_reduce
writes the sum in place).

Why gather the logits rather than a distributed argmax: the sampler needs the whole row - the
temperature's softmax, top-p/top-k, logprobs, repetition penalties and a structured-output mask
all read every token's score. The gather costs L x V x 4 bytes a step (``RankTimings``).

A caller may have every worker set itself up before it loads its shard (``setup``, a function
the workers import by name: they are fresh processes and inherit no change the caller made to its
own modules), and ask every rank a question afterwards (``collect``): the course runs the
learner's column/row split in the ranks this way (minillm/course/tensor_parallel_seat.py).

A rank that dies ends the run with an error naming it: gloo fails a collective whose peer has
gone, every collective has a timeout, and rank 0 checks its workers before each step. Closing
the group (or losing the last reference to it, or the interpreter exiting) stops the workers.
"""
from __future__ import annotations

import signal
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import connection as mp_connection
from pathlib import Path

import numba
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minillm.generation.sampling import Sampler
from minillm.hardware.collectives import free_port
from minillm.model.config import ModelConfig
from minillm.model.kv_cache import AttentionMetadata
from minillm.model.sharding import Shard, ShardedModel, read_shard
from minillm.model.transformer import ModelWeights
from minillm.runtime.block_manager import BlockManager
from minillm.runtime.model_runner import ModelRunner
from minillm.runtime.paged_cache import PagedKVCache

DEFAULT_TIMEOUT = 60.0  # seconds a collective may wait for a rank before the run fails


class RankFailed(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the group cannot run another step."""


@dataclass(frozen=True)
class RankTimings:
    """Where one rank's time went since the last reset."""
    rank: int
    steps: int
    forward_seconds: float      # inside the model's forward, collectives included
    collective_seconds: float   # inside all-reduce and gather
    gathered_bytes: int         # logits received by the gather (rank 0) or sent to it

    @property
    def collective_share(self) -> float:
        return self.collective_seconds / self.forward_seconds if self.forward_seconds else 0.0


class Collectives:
    """One rank's collectives, timed; the tensors are views of the NumPy arrays (no copy)."""

    def __init__(self, rank: int, vocab_sizes: list[int]):
        self.rank, self.vocab_sizes = rank, vocab_sizes  # vocab_sizes: each rank's slice width
        self.reset()

    def reset(self) -> None:
        self.steps, self.forward_seconds, self.collective_seconds, self.gathered_bytes = 0, 0.0, 0.0, 0

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        """The sum of x over the ranks, written into x: (N, D) float32."""
        x = np.ascontiguousarray(x)
        start = time.perf_counter()
        dist.all_reduce(torch.from_numpy(x))
        self.collective_seconds += time.perf_counter() - start
        return x

    def gather(self, logits: np.ndarray) -> np.ndarray | None:
        """(L, V_r) slices -> (L, V) on rank 0, None elsewhere. Slices are padded to the widest:
        gloo's gather moves equal shapes."""
        width = max(self.vocab_sizes)
        padded = np.zeros((logits.shape[0], width), dtype=np.float32)   # (L, max V_r)
        padded[:, :logits.shape[1]] = logits
        start = time.perf_counter()
        if self.rank == 0:
            parts = [torch.from_numpy(np.empty_like(padded)) for _ in self.vocab_sizes]
            dist.gather(torch.from_numpy(padded), parts, dst=0)
            out = np.concatenate([p.numpy()[:, :v] for p, v in zip(parts, self.vocab_sizes)], axis=1)  # (L, V)
        else:
            dist.gather(torch.from_numpy(padded), None, dst=0)
            out = None
        self.collective_seconds += time.perf_counter() - start
        self.gathered_bytes += padded.nbytes * (len(self.vocab_sizes) - 1 if self.rank == 0 else 1)
        return out

    def timings(self) -> RankTimings:
        return RankTimings(self.rank, self.steps, self.forward_seconds, self.collective_seconds, self.gathered_bytes)


def build_rank(config: ModelConfig, shard: Shard, weights: ModelWeights, backend: str, activations: str
               ) -> tuple[ShardedModel, Collectives]:
    """A rank's model, from what ``read_shard`` gives, wired to its collectives."""
    widths = [Shard.plan(config, shard.world_size, r).vocab for r in range(shard.world_size)]
    collectives = Collectives(shard.rank, [stop - start for start, stop in widths])
    model = ShardedModel.build(config, weights, shard, backend, activations, collectives.all_reduce, collectives.gather)
    return model, collectives


def timed_forward(model: ShardedModel, collectives: Collectives, token_ids: np.ndarray, meta: AttentionMetadata,
                  cache: PagedKVCache, num_layers: int | None = None) -> np.ndarray | None:
    start = time.perf_counter()
    logits = model.forward(token_ids, meta, cache, num_layers=num_layers)
    collectives.forward_seconds += time.perf_counter() - start
    collectives.steps += 1
    return logits


# -----------------------------------------------------------------------------
# ranks 1 .. N-1

def worker(rank: int, world_size: int, path: str, backend: str, activations: str, init_method: str,
           timeout: float, threads: int, started, setup: Callable[[], None] | None) -> None:
    """A worker rank's life: set up, say it started, join the group, load its shard, follow rank 0's messages."""
    # Ctrl-C in a terminal reaches every process of the group: rank 0 decides when the ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if setup is not None:  # before `started`: a setup that fails ends the group's start at once
        setup()
    started.send(rank)
    started.close()
    numba.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    model, collectives = build_rank(*read_shard(Path(path), world_size, rank), backend, activations)
    cache = None
    try:
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=0)
            kind, *args = message[0]
            if kind == "step":
                copies, token_ids, meta, num_layers = args
                for src, dst in copies:
                    cache.copy_block(src, dst)
                timed_forward(model, collectives, token_ids, meta, cache, num_layers)
            elif kind == "cache":
                cache = PagedKVCache(model.config, *args, model.ops)
            elif kind == "collect":
                dist.gather_object(args[0](), None, dst=0)
            elif kind == "timings":
                dist.gather_object(collectives.timings(), None, dst=0)
                if args[0]:
                    collectives.reset()
            elif kind == "stop":
                break
    finally:
        dist.destroy_process_group()


# -----------------------------------------------------------------------------
# rank 0

class TensorParallelGroup:
    """Rank 0's side: starts the other ranks, holds its own shard, sends each step's plan.

    ``threads``: Numba threads per rank (default: this process's threads shared out, at least 1).
    ``timeout``: seconds any collective waits for the others before the run fails.
    ``setup``: a function every worker calls first, before it loads its shard; it is pickled to
    them by name (a module-level function, or a ``functools.partial`` of one). Rank 0 is this
    process: the caller sets it up itself.
    One group per process at a time (it uses torch.distributed's default process group).
    """

    def __init__(self, path: str | Path, world_size: int, backend: str = "numba", activations: str = "fp32",
                 threads: int | None = None, timeout: float = DEFAULT_TIMEOUT, setup: Callable[[], None] | None = None):
        if not isinstance(world_size, int) or world_size < 2:
            raise ValueError(f"tensor_parallel_size must be an integer >= 2 for a group, got {world_size!r}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        path = Path(path)
        rank0 = read_shard(path, world_size, 0)  # refuses a split (Shard.plan) before any process starts
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel group is already running in this process: close it first")
        self.world_size, self.timeout = world_size, timeout
        self.threads = threads or max(1, numba.config.NUMBA_NUM_THREADS // world_size)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        context = mp.get_context("spawn")
        started, started_writer = context.Pipe(duplex=False)
        self.workers = [context.Process(target=worker, daemon=True, name=f"minillm-tp-rank{rank}",
                                        args=(rank, world_size, str(path), backend, activations, init_method,
                                              timeout, self.threads, started_writer, setup))
                        for rank in range(1, world_size)]
        self._state = {"open": True, "initialized": False}
        self._finalizer = weakref.finalize(self, shutdown, self.workers, self._state)
        for p in self.workers:
            p.start()
        started_writer.close()
        try:
            self._wait_started(started)
            try:
                dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=world_size,
                                        timeout=timedelta(seconds=timeout))
            except Exception as e:
                self._fail(e)
            self._state["initialized"] = True
            self.model, self.collectives = build_rank(*rank0, backend, activations)
        except BaseException:
            self.close()   # no worker outlives a failed start
            raise

    def _wait_started(self, started) -> None:
        """Until every worker has run its first line: one that dies importing (a script without
        ``if __name__ == "__main__":`` under spawn) fails the start now, not after the timeout."""
        waiting, deadline = set(range(1, self.world_size)), time.monotonic() + self.timeout
        while waiting and time.monotonic() < deadline:
            ready = mp_connection.wait([started] + [p.sentinel for p in self.workers], timeout=0.5)
            if started in ready:
                try:
                    waiting.discard(started.recv())
                except EOFError:
                    pass
            self.check_alive(hint=" while starting (its traceback is on stderr; under spawn, a script that starts "
                                  "ranks needs `if __name__ == \"__main__\":`)")
        started.close()
        if waiting:
            raise RankFailed(f"tensor-parallel ranks {sorted(waiting)} did not start within {self.timeout} s")

    # ---- messages to the workers ----------------------------------------------------------

    def send(self, *message) -> None:
        self.check_alive()
        try:
            dist.broadcast_object_list([message], src=0)
        except Exception as e:
            self._fail(e)

    def forward(self, token_ids: np.ndarray, meta: AttentionMetadata, cache: PagedKVCache,
                num_layers: int | None = None) -> np.ndarray:
        """Rank 0's part of a forward the workers were sent: its forward, then the gathered logits (L, V)."""
        threads = numba.get_num_threads()
        numba.set_num_threads(self.threads)  # per calling thread in Numba: the server steps in its own
        try:
            return timed_forward(self.model, self.collectives, token_ids, meta, cache, num_layers)
        except Exception as e:
            self._fail(e)
        finally:
            numba.set_num_threads(threads)

    def collect(self, question: Callable[[], object]) -> list:
        """``question()`` asked in every rank's process, the answers in rank order. Like ``setup``,
        it is pickled to the workers by name. Call it from the thread that steps the engine."""
        self.send("collect", question)
        replies = [None] * self.world_size
        try:
            dist.gather_object(question(), replies, dst=0)
        except Exception as e:
            self._fail(e)
        return replies

    def timings(self, reset: bool = False) -> list[RankTimings]:
        """Every rank's ``RankTimings``, in rank order; ``reset`` starts the counts again. Call it
        from the thread that steps the engine: it is a message to the ranks, like a step."""
        self.send("timings", reset)
        replies = [None] * self.world_size
        try:
            dist.gather_object(self.collectives.timings(), replies, dst=0)
        except Exception as e:
            self._fail(e)
        if reset:
            self.collectives.reset()
        return replies

    def runner(self, block_manager: BlockManager, sampler: Sampler) -> TensorParallelRunner:
        return TensorParallelRunner(self, block_manager, sampler)

    # ---- failure and shutdown -------------------------------------------------------------

    def check_alive(self, hint: str = "") -> None:
        if not self._state["open"]:
            raise RankFailed("the tensor-parallel group is closed")
        dead = [(rank, p.exitcode) for rank, p in enumerate(self.workers, 1) if p.exitcode is not None]
        if dead:
            self.close()
            raise RankFailed(", ".join(f"tensor-parallel rank {r} died (exit code {c})" for r, c in dead)
                             + hint + ": the run cannot go on")

    def _fail(self, error: Exception):
        """A collective failed: name the rank that died if one did (give it a moment to be reaped)."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and all(p.exitcode is None for p in self.workers):
            time.sleep(0.05)
        self.check_alive()   # raises, naming the dead rank
        self.close()
        raise RankFailed(f"a tensor-parallel collective failed (no rank exited; one stopped answering "
                         f"within {self.timeout} s?): {error}") from error

    def close(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._state["open"]


def shutdown(workers: list, state: dict) -> None:
    """Tell live workers to stop, wait briefly, kill what remains; leave the group."""
    state["open"] = False
    if state["initialized"] and all(p.exitcode is None for p in workers):
        try:
            dist.broadcast_object_list([("stop",)], src=0)
        except Exception:
            pass  # a worker is already gone: the kill below ends the rest
    for p in workers:
        p.join(timeout=5)
        if p.exitcode is None:
            p.kill()
            p.join()
    if dist.is_initialized():
        dist.destroy_process_group()


class TensorParallelRunner(ModelRunner):
    """The engine's ModelRunner for a group: rank 0's cache, forward and sampler; each forward sent to the
    workers first, so every rank applies the same copy-on-write copies before the same writes."""

    def __init__(self, group: TensorParallelGroup, block_manager: BlockManager, sampler: Sampler):
        super().__init__(group.model, block_manager, sampler)
        self.group = group
        group.send("cache", block_manager.num_blocks, block_manager.block_size)

    def forward(self, copies: list[tuple[int, int]], token_ids: np.ndarray, meta: AttentionMetadata,
                num_layers: int | None = None) -> np.ndarray:
        self.group.send("step", copies, token_ids, meta, num_layers)
        for src, dst in copies:
            self.cache.copy_block(src, dst)
        return self.group.forward(token_ids, meta, self.cache, num_layers)
