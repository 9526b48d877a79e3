"""A decode-side peer process for the transport tests: owns a KV tensor, serves commands.

Run as ``python -m tests.unit.engine.transport.kv_peer NAME OPTIONS_JSON`` (the
transport's keyword arguments; ``limits`` is a dict of ``ChannelLimits`` fields). It prints
one JSON line (endpoint, tensor address and size, pid), then answers one JSON line per
stdin command: ``fill SEED``, ``dump`` (base64 of the tensor), ``notify PEER TEXT``,
``notes`` (notifications received so far), ``exit``. ``Peer`` starts and drives one
from a test.
"""

from __future__ import annotations

import base64
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from pdserve.engine.kv_transfer.transport import create_transport
from pdserve.engine.kv_transfer.transport.limits import ChannelLimits
from pdserve.engine.kv_transfer.transport.shm import allocate_shm_tensor

# [num_layers, K|V, num_blocks, block_size, kv_heads, head_dim]: 4 KiB per block piece.
KV_SHAPE = (2, 2, 8, 16, 2, 64)
KV_DTYPE = torch.float16
NUM_BLOCKS = KV_SHAPE[2]
BLOCK_BYTES = int(np.prod(KV_SHAPE[3:])) * torch.empty((), dtype=KV_DTYPE).element_size()
REPO = Path(__file__).resolve().parents[4]


def piece_addr(base: int, layer: int, kv: int, block: int) -> int:
    return base + ((layer * 2 + kv) * NUM_BLOCKS + block) * BLOCK_BYTES


def allocate_kv(name: str):
    """The KV tensor and the object that owns its memory (ShmTensor for shm)."""
    if name == "shm":
        owner = allocate_shm_tensor(KV_SHAPE, KV_DTYPE)
        return owner.tensor, owner
    tensor = torch.zeros(KV_SHAPE, dtype=KV_DTYPE)
    return tensor, None


def fill(tensor: torch.Tensor, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensor.copy_(torch.randn(tensor.shape, generator=gen).to(tensor.dtype))


def main() -> None:
    name, options = sys.argv[1], json.loads(sys.argv[2])
    if "limits" in options:
        options["limits"] = ChannelLimits(**options["limits"])
    transport = create_transport(name, **options)
    kv, owner = allocate_kv(name)
    transport.register_memory(kv.data_ptr(), kv.nbytes)
    reply({"endpoint": transport.endpoint, "addr": kv.data_ptr(), "nbytes": kv.nbytes})
    notes: list = []
    for line in sys.stdin:
        cmd, *args = line.split(maxsplit=2)
        if cmd == "fill":
            fill(kv, int(args[0]))
            reply("ok")
        elif cmd == "dump":
            reply(base64.b64encode(kv.numpy().tobytes()).decode())
        elif cmd == "notify":
            transport.notify(args[0], args[1].strip().encode())
            reply("ok")
        elif cmd == "notes":
            notes += [[peer, msg.decode()] for peer, msg, _ in transport.recv_notifications()]
            reply(notes)
        elif cmd == "exit":
            break
    transport.close()
    if owner is not None:
        owner.close()


class Peer:
    """One kv_peer child process, driven line by line over stdin/stdout."""

    def __init__(self, name: str, log_dir: Path, **options) -> None:
        self.log_path = log_dir / f"{name}-peer-{time.monotonic_ns()}.log"
        with open(self.log_path, "w") as log:  # the child keeps its own copy of the fd
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.unit.engine.transport.kv_peer", name,
                 json.dumps(options)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                text=True, cwd=REPO,
            )
        info = self.ask(None)
        self.endpoint, self.addr, self.nbytes = info["endpoint"], info["addr"], info["nbytes"]

    def ask(self, command: str | None):
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"peer exited; its log:\n{self.log_path.read_text()[-2000:]}"
        return json.loads(line)

    def dump(self) -> torch.Tensor:
        raw = base64.b64decode(self.ask("dump"))
        return torch.frombuffer(bytearray(raw), dtype=KV_DTYPE).view(KV_SHAPE)

    def piece(self, layer: int, kv: int, block: int) -> int:
        return piece_addr(self.addr, layer, kv, block)

    def reap(self) -> int:
        if self.proc.poll() is None:
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
        code = self.proc.wait(timeout=30)  # NIXL alone takes ~2 s to exit; a loaded box, more
        for path in glob.glob(f"/dev/shm/pdserve-kv-{self.proc.pid}-*"):
            os.unlink(path)  # what the node agent does for an engine that died
        return code


def reply(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
