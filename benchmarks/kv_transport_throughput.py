"""KV transport throughput: block-sized pieces through each transport vs. raw limits.

A receiver process (D) owns one KV region per transport; this process (P) pushes
``--total-mib`` of KV into it as (layer, K|V, block) pieces of
``block_tokens x kv_heads x head_dim x dtype_bytes`` bytes, landing in a shuffled
order of D's blocks (as a real block table does, so nothing coalesces unless
``--layout contiguous``; ``--layout sparse``: in a shuffled order of every other
block of a region twice as large, as in a cache whose free blocks are scattered). Limits measured in the same run: a raw socket copy
(one sendall / recv_into of the whole region, then a 1-byte ack, over loopback),
the limit of tcp and mooncake, and a single-threaded memcpy (ctypes.memmove), the
limit of shm and of nixl on one host (UCX copies with cma, one process writing
into the other's memory); every transport is shown against both.
Rounds interleave every path, so load from other processes hits all of them alike.

    .venv/bin/python benchmarks/kv_transport_throughput.py [--total-mib 64] [--repeats 10]
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import socket
import statistics
import threading
import time

import numpy as np
import torch

from pdserve.engine.kv_transfer.transport import create_transport
from pdserve.engine.kv_transfer.transport.shm import allocate_shm_tensor

TOKEN = "bench"


def allocate(name: str, num_bytes: int):
    if name == "shm":
        owner = allocate_shm_tensor((num_bytes,), torch.uint8)
        return owner.tensor, owner
    return torch.zeros(num_bytes, dtype=torch.uint8), None


def receiver(conn, names: list[str], num_bytes: int, region_bytes: int) -> None:
    """D: registers one region per transport, serves a raw socket sink, waits for 'done'."""
    keep, offers = [], {}
    for name in names:
        transport = create_transport(name, auth_token=TOKEN, timeout_s=30.0)
        kv, owner = allocate(name, region_bytes)
        transport.register_memory(kv.data_ptr(), kv.nbytes)
        keep.append((transport, kv, owner))
        offers[name] = (transport.endpoint, kv.data_ptr())
    sink = torch.zeros(num_bytes, dtype=torch.uint8)
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=raw_sink, args=(listener, sink), daemon=True).start()
    conn.send((offers, listener.getsockname()[1]))
    conn.recv()
    for transport, _, owner in keep:
        transport.close()
        if owner is not None:
            owner.close()


def raw_sink(listener: socket.socket, sink: torch.Tensor) -> None:
    sock, _ = listener.accept()
    view = memoryview(sink.numpy()).cast("B")
    while True:
        got = 0
        while got < len(view):
            n = sock.recv_into(view[got:])
            if n == 0:
                return
            got += n
        sock.sendall(b"k")


class RawSocket:
    """The limit for network transports: one sendall of the whole region, then an ack."""

    def __init__(self, port: int, src: torch.Tensor) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.view = memoryview(src.numpy()).cast("B")

    def run_once(self) -> None:
        self.sock.sendall(self.view)
        self.sock.recv(1)

    def close(self) -> None:
        self.sock.close()


class Memcpy:
    """The limit for shared memory: one single-threaded memmove of the whole region."""

    def __init__(self, src: torch.Tensor) -> None:
        self.src, self.dst = src, torch.zeros_like(src)

    def run_once(self) -> None:
        ctypes.memmove(self.dst.data_ptr(), self.src.data_ptr(), self.src.nbytes)

    def close(self) -> None:
        pass


class TransportPush:
    """P's side of one transport: a KV region and the batch of block pieces it pushes."""

    def __init__(self, name, endpoint, remote_base, num_bytes, piece_bytes, layout):
        self.transport = create_transport(name, auth_token=TOKEN, timeout_s=30.0)
        self.src, self.owner = allocate(name, num_bytes)
        self.src.copy_(torch.randint(0, 256, (num_bytes,), dtype=torch.uint8))
        self.transport.register_memory(self.src.data_ptr(), self.src.nbytes)
        num_pieces = num_bytes // piece_bytes
        order = np.arange(num_pieces)
        if layout in ("scattered", "sparse"):
            order = np.random.default_rng(0).permutation(num_pieces)
        if layout == "sparse":
            order = order * 2
        self.items = np.stack([  # the array form of list[TransferItem]
            self.src.data_ptr() + np.arange(num_pieces) * piece_bytes,
            remote_base + order * piece_bytes,
            np.full(num_pieces, piece_bytes),
        ], axis=1)
        self.endpoint = endpoint

    def run_once(self) -> None:
        status = self.transport.write_batch(self.endpoint, self.items).wait()
        if not status.is_done:
            raise RuntimeError(f"{self.transport.name}: {status.message}")

    def close(self) -> None:
        self.transport.close()
        if self.owner is not None:
            self.owner.close()


def gib_per_s(num_bytes: int, seconds: list[float]) -> float:
    return num_bytes / statistics.median(seconds) / (1 << 30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=64)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype-bytes", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--layout", choices=["scattered", "contiguous", "sparse"], default="scattered")
    parser.add_argument("--transports", default="tcp,shm,mooncake,nixl")
    args = parser.parse_args()
    names = args.transports.split(",")
    num_bytes = args.total_mib << 20
    piece_bytes = args.block_tokens * args.kv_heads * args.head_dim * args.dtype_bytes

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    region_bytes = num_bytes * (2 if args.layout == "sparse" else 1)
    child = ctx.Process(target=receiver, args=(there, names, num_bytes, region_bytes))
    child.start()
    offers, raw_port = here.recv()
    src = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8)
    paths = {"raw socket": RawSocket(raw_port, src), "memcpy": Memcpy(src)}
    for name in names:
        endpoint, base = offers[name]
        paths[name] = TransportPush(name, endpoint, base, num_bytes, piece_bytes, args.layout)
    times: dict[str, list[float]] = {label: [] for label in paths}
    for round_index in range(args.repeats + 1):
        for label, path in paths.items():
            start = time.monotonic()
            path.run_once()
            if round_index:  # round 0 warms pages, connections and buffers
                times[label].append(time.monotonic() - start)
    for path in paths.values():
        path.close()
    here.send("done")
    child.join()

    print(f"{args.total_mib} MiB in {num_bytes // piece_bytes} pieces of {piece_bytes} B "
          f"({args.layout}), median of {args.repeats} interleaved rounds")
    print(f"{'path':<12}{'GiB/s':>8}{'ms':>8}{'best ms':>9}{'vs raw socket':>15}{'vs memcpy':>11}")
    raw, copy = (gib_per_s(num_bytes, times[label]) for label in ("raw socket", "memcpy"))
    for label, path_times in times.items():
        rate = gib_per_s(num_bytes, path_times)
        print(f"{label:<12}{rate:8.2f}{statistics.median(path_times) * 1e3:8.1f}"
              f"{min(path_times) * 1e3:9.1f}{rate / raw:15.0%}{rate / copy:11.0%}")

if __name__ == "__main__":
    main()
