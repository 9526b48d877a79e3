"""Same-node transport: P copies straight into D's KV cache through POSIX shared memory.

D creates its KV tensor in a /dev/shm file (``ShmTensor``) and registers it; the
WELCOME reply on the channel names the file and where it is mapped in D. P maps
the file once per peer and copies the items into it (``staging.copy_pieces``: one
numpy row copy per run of the side whose pieces are few runs, else one
``ctypes.memmove`` per item; the GIL is released during the copies). A batch is DONE only after D answers a FENCE on the channel, so a dead
or stopped D makes the batch FAILED even though the copy itself never needs D.

A segment is named ``/dev/shm/pdserve-kv-<pid>-<12 hex digits>``, ``<pid>`` being the
engine process that created it: the engine unlinks it on shutdown and at exit, and a
supervisor removes ``pdserve-kv-<pid>-*`` of an engine that died.

Invariants:
- Only memory inside a /dev/shm mapping can be registered; P only touches ranges
  inside regions D registered (checked before the first byte moves).
- Peers must share a kernel (same boot id) and /dev/shm; otherwise batches FAIL
  with that reason. On Kubernetes this means one pod, or a shared memory volume.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import socket
import threading
import uuid

import numpy as np
import torch

from pdserve.engine.kv_transfer.transport.base import BatchHandle
from pdserve.engine.kv_transfer.transport.channel_transport import Batch, ChannelTransport
from pdserve.engine.kv_transfer.transport.limits import ChannelLimits
from pdserve.engine.kv_transfer.transport.link import PeerLink
from pdserve.engine.kv_transfer.transport.staging import copy_pieces

SHM_DIR = "/dev/shm"


class ShmTensor:
    """A torch tensor whose storage is a /dev/shm file (named as the module docstring
    says). Created by the engine's runner."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, name: str | None = None):
        numel = math.prod(shape)
        num_bytes = numel * torch.empty((), dtype=dtype).element_size()
        self.name = name or f"pdserve-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.path = os.path.join(SHM_DIR, self.name)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, num_bytes)
            self._mmap = mmap.mmap(fd, num_bytes)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._mmap, dtype=dtype, count=numel).view(shape)

    def close(self) -> None:
        """Unlink the file; the memory lives on while the tensor or a peer maps it."""
        if os.path.exists(self.path):
            os.unlink(self.path)


def allocate_shm_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, name: str | None = None
) -> ShmTensor:
    """Where the engine allocates its KV cache when the transport is shm."""
    return ShmTensor(shape, dtype, name)


def find_shm_mapping(ptr: int, length: int) -> dict:
    """The /dev/shm mapping of this process that holds [ptr, ptr+length), from /proc/self/maps."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or not fields[5].startswith(SHM_DIR + "/"):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= ptr and ptr + length <= end:
                return {"path": fields[5].strip(), "base": start, "length": end - start,
                        "file_offset": int(fields[2], 16)}
    raise ValueError(
        f"[{ptr:#x}, +{length}) is not inside a {SHM_DIR} mapping; allocate the KV cache "
        "with allocate_shm_tensor() to use the shm transport"
    )


def _boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


class ShmTransport(ChannelTransport):
    name = "shm"

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, auth_token: str | None = None,
                 timeout_s: float = 10.0, limits: ChannelLimits | None = None) -> None:
        self._segments: list[dict] = []
        self._maps: dict[str, tuple[mmap.mmap, ctypes.c_char, int]] = {}  # path -> map
        self._copy_lock = threading.Lock()
        self._boot_id = _boot_id()
        super().__init__(host=host, port=port, auth_token=auth_token, timeout_s=timeout_s,
                         limits=limits)

    def register_memory(self, ptr: int, length: int) -> None:
        self._segments.append(find_shm_mapping(ptr, length))
        super().register_memory(ptr, length)

    def close(self) -> None:
        super().close()
        with self._copy_lock:  # never unmap under a running copy
            maps, self._maps = self._maps, {}
            while maps:
                mm, _, _ = maps.popitem()[1]  # drops the ctypes anchor, then unmaps
                with contextlib.suppress(BufferError):
                    mm.close()

    def _welcome(self) -> dict:
        return {**super()._welcome(), "segments": self._segments, "boot_id": self._boot_id}

    def _check_peer(self, link: PeerLink) -> None:
        if link.info.get("boot_id") != self._boot_id:
            raise RuntimeError(f"peer {link.peer} is on another node; shm needs one host")

    def _move(self, link: PeerLink, sock: socket.socket, handle: BatchHandle, batch: Batch) -> None:
        """Copy every item through our mapping of the peer's file, then FENCE: D's ACK
        finishes the batch, so a dead or stopped D still FAILs it."""
        mapped = self._translate(link.info["segments"], batch.remote, batch.lengths)
        ours = self._regions.as_list()
        with self._copy_lock:
            theirs = [(addr, mm.size()) for mm, _, addr in self._maps.values()]
            if batch.is_write:
                copy_pieces(batch.local, mapped, batch.lengths, ours, theirs)
            else:
                copy_pieces(mapped, batch.local, batch.lengths, theirs, ours)
        self._fence(link, sock, handle)

    def _translate(self, segments: list[dict], remote: np.ndarray, lengths: np.ndarray):
        """Peer addresses -> our mapping of the same bytes (maps a peer file on first use)."""
        mapped = np.full(len(remote), -1, dtype=np.int64)
        for seg in segments:
            base, size = seg["base"], seg["length"]
            hit = (remote >= base) & (remote + lengths <= base + size)
            if hit.any():
                mapped[hit] = self._map(seg["path"]) + seg["file_offset"] + remote[hit] - base
        if (mapped < 0).any():
            bad = int(remote[np.flatnonzero(mapped < 0)[0]])
            raise ValueError(f"remote address {bad:#x} is in no shared segment of the peer")
        return mapped

    def _map(self, path: str) -> int:
        if path not in self._maps:
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                raise RuntimeError(f"{path} is not visible here (/dev/shm not shared)") from None
            try:
                mm = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            anchor = ctypes.c_char.from_buffer(mm)
            self._maps[path] = (mm, anchor, ctypes.addressof(anchor))
        return self._maps[path][2]
