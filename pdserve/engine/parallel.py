"""Tensor parallelism: one engine sharded over ``tensor_parallel_size`` ranks, one process
and one device each, over ``torch.distributed`` (gloo on CPU, NCCL on CUDA, HCCL on NPU:
the same code, the backend chosen from the device).

How a model is split (Megatron's layout, ``model.py`` and ``loader.py``):
- q/k/v and gate/up are column-parallel: each rank holds its attention heads' rows of
  q, its KV heads' rows of k and v, and its slice of the intermediate size. o_proj and
  down_proj are row-parallel: each rank multiplies its slice and the partial sums are
  all-reduced (two all-reduces per layer; an o_proj bias is added once, after it).
- KV heads are split across ranks; when ``tensor_parallel_size`` exceeds the KV head
  count, each KV head is replicated on ``size / num_kv_heads`` consecutive ranks, so every
  rank's query heads find their KV head locally. Each rank's KV cache holds its own heads.
- The embedding and lm_head are replicated, not vocab-parallel: the sampler on rank 0
  then sees whole logits with no gather per step, and the embedding needs no masked
  lookup plus all-reduce. The cost is ``2 * vocab * hidden`` weights on every rank (about
  1 GiB in bf16 for a 150K vocabulary at hidden 3584), small next to a sharded 7B body.

Processes: rank 0 is the engine's own process (scheduler, gRPC, sampling); ``TPWorkers``
starts ranks 1..N-1 (``spawn``) and supervises them. Each step, rank 0's runner sends the
step's inputs (token ids, positions, attention metadata) to every worker over a pipe, then
all ranks run the same forward, meeting in the all-reduces; only rank 0 computes logits.
Steps travel on pipes rather than a collective so that an idle engine has no collective
pending (a broadcast waiting for the next request would hit the backend's timeout).

KV caches: each rank holds its own heads. An engine with a KV transport keeps every
rank's cache in one region rank 0 allocates (``create_shared_kv``; the other ranks map
their slab of it), so rank 0's connector moves every rank's heads without a transport
per rank (``kv_transfer/layout.py`` re-lays them out for a peer split differently).

Invariants: the ranks run the same sequence of forwards (rank 0 sends before it computes);
a worker that exits takes the engine down (log line naming the rank, exit code 1) so that
its supervisor restarts the whole engine; rank 0 going away ends every worker (pipe closed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import mmap
import multiprocessing
import multiprocessing.connection
import multiprocessing.reduction
import os
import pickle
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pdserve.engine.config import kv_heads_of
from pdserve.engine.device import prepare_device
from pdserve.runtime.ports import free_port

log = logging.getLogger(__name__)

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the engine's tensor-parallel group; ``size`` 1 is no
    parallelism (no collective is ever called)."""

    rank: int = 0
    size: int = 1

    def split(self, total: int) -> tuple[int, int]:
        """(first, count) of this rank's equal share of ``total`` (heads, features)."""
        count = total // self.size
        return self.rank * count, count

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first, count) of this rank's KV heads: its share, or the one head it replicates
        when there are fewer KV heads than ranks."""
        return kv_heads_of(self.rank, self.size, num_kv_heads)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks in place (row-parallel outputs)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: ``cuda:3`` for rank 1 of an engine started on ``cuda:2``."""
    kind, _, index = device.partition(":")
    if kind == "cpu":
        return "cpu"
    return f"{kind}:{int(index or 0) + rank}"


def create_shared_kv(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """Rank 0: a KV tensor the ranks of one engine share, ``shape`` being ``(ranks, *one
    rank's cache)``, in an anonymous memory file (gone once the last rank exits, crash or
    not), and that file's descriptor for ``TPWorkers.start_cache``. Rank 0's KV connector
    registers every rank's slab as one region and moves every rank's heads itself."""
    fd = os.memfd_create("pdserve-kv")
    os.ftruncate(fd, math.prod(shape) * torch.empty((), dtype=dtype).element_size())
    return map_shared_kv(shape, dtype, fd), fd


def map_shared_kv(shape: tuple[int, ...], dtype: torch.dtype, fd: int) -> torch.Tensor:
    """The shared KV tensor of ``create_shared_kv`` (or a /dev/shm file) mapped from ``fd``."""
    count = math.prod(shape)
    mapping = mmap.mmap(fd, count * torch.empty((), dtype=dtype).element_size())
    return torch.frombuffer(mapping, dtype=dtype, count=count).view(shape)


def _init_group(rank: int, size: int, port: int, device: str) -> None:
    """Join the engine's group as ``rank``; NCCL and HCCL bind to the current device, so
    it is set first."""
    local = rank_device(device, rank)
    if local != "cpu":
        getattr(torch, local.split(":")[0]).set_device(local)
    dist.init_process_group(BACKENDS[device.split(":")[0]], init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=size)


def _moved(obj, device: torch.device):
    """``obj`` (a tensor, a list, a dataclass of them) with every tensor on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, list):
        return [_moved(o, device) for o in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _moved(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj)})
    return obj


class TPWorkers:
    """Ranks 1..N-1 of one engine. Built by ``LLMEngine`` (rank 0) before it loads its own
    shard; ``start_cache`` once rank 0 knows the KV block count, ``send_step`` from the
    runner before each forward (engine thread), ``close`` at shutdown."""

    def __init__(self, config) -> None:
        self.size = config.tensor_parallel_size
        prepare_device(rank_device(config.device, 0))  # a missing device fails here, alone
        port = free_port()
        ctx = multiprocessing.get_context("spawn")
        self._conns = []
        self._procs = []
        for rank in range(1, self.size):
            ours, theirs = ctx.Pipe()
            level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
            proc = ctx.Process(target=_worker_main,
                               args=(rank, self.size, port, config, theirs, level),
                               name=f"pdserve-tp-rank{rank}", daemon=True)
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(proc)
        self._closing = threading.Event()
        threading.Thread(target=self._watch, name="tp-supervisor", daemon=True).start()
        _init_group(0, self.size, port, config.device)
        log.info("tensor parallel: %d ranks (%s), workers %s", self.size,
                 BACKENDS[config.device.split(":")[0]], [p.pid for p in self._procs])

    def _watch(self) -> None:
        """A worker that exits while the engine runs ends the engine: its weights and KV
        heads are gone, so no step can complete; the supervisor restarts it whole."""
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self._procs, start=1)}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._closing.is_set():
            return
        rank, proc = sentinels[ready[0]]
        proc.join()
        log.error("tensor-parallel rank %d (pid %d) exited with code %s: stopping the engine",
                  rank, proc.pid, proc.exitcode)
        for other in self._procs:
            if other.is_alive():
                other.kill()
        logging.shutdown()
        os._exit(1)

    def start_cache(self, num_blocks: int, block_size: int, shared_fd: int | None = None) -> None:
        """Every worker allocates its KV cache, or, with ``shared_fd`` (a file holding one
        slab per rank, rank 0's first: ``create_shared_kv``), maps its slab of it; returns once
        all are ready to step. ``shared_fd`` is closed here: every rank maps the file then."""
        try:
            self._send(("cache", (num_blocks, block_size, shared_fd is not None)))
            for conn, proc in zip(self._conns, self._procs, strict=True):
                if shared_fd is not None:
                    multiprocessing.reduction.send_handle(conn, shared_fd, proc.pid)
        finally:
            if shared_fd is not None:
                os.close(shared_fd)
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.recv_bytes()
            except EOFError:
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start") from None

    def send_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> None:
        cpu = torch.device("cpu")
        self._send(("step", (input_ids.to(cpu), positions.to(cpu), _moved(meta, cpu))))

    def _send(self, message) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self._conns:
            conn.send_bytes(data)

    def close(self) -> None:
        """Stop the workers and leave the process group; idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        for conn in self._conns:
            with contextlib.suppress(OSError):  # a worker that already exited
                conn.send_bytes(pickle.dumps(("stop", None)))
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        dist.destroy_process_group()


def _worker_main(rank: int, size: int, port: int, config, conn, log_level: str) -> None:
    """Rank ``rank``: load its shard, allocate its KV cache, run every step rank 0 sends."""
    from pdserve.engine.loader import load_model
    from pdserve.engine.runner import ModelRunner
    from pdserve.runtime import gc_tuning
    from pdserve.runtime.logs import configure_logging

    configure_logging(log_level)
    device = rank_device(config.device, rank)
    prepare_device(device, config.num_threads)
    _init_group(rank, size, port, config.device)
    model, _ = load_model(config.model, config.dtype, device, TensorParallel(rank, size),
                          config.prepack_weights)
    runner = None
    while True:
        try:
            kind, payload = pickle.loads(conn.recv_bytes())
        except EOFError:
            log.error("tensor-parallel rank %d: rank 0 went away; exiting", rank)
            raise SystemExit(1) from None
        if kind == "stop":
            dist.destroy_process_group()
            return
        if kind == "cache":
            num_blocks, block_size, shared = payload
            allocate = None
            if shared:
                fd = multiprocessing.reduction.recv_handle(conn)

                def allocate(shape, dtype, fd=fd):
                    return map_shared_kv((size, *shape), dtype, fd)[rank]
            runner = ModelRunner(model, num_blocks, block_size, allocate)
            if shared:
                os.close(fd)  # the mapping stays
            gc_tuning.tune()  # started: the shard and its cache are frozen out of collections
            conn.send_bytes(b"ready")
            continue
        ids, positions, meta = _moved(list(payload), runner.device)
        model(ids, positions, runner.kv_slots, meta)
