"""A decode-side peer process for the transport tests: owns a KV tensor, serves commands.

Run as ``python -m tests.unit.engine.transport.kv_peer NAME OPTIONS_JSON``. It prints
one JSON line (endpoint, tensor address and size, pid), then answers one JSON line per
stdin command: ``fill SEED``, ``dump`` (base64 of the tensor), ``notify PEER TEXT``,
``notes`` (notifications received so far), ``exit``.
"""

from __future__ import annotations

import base64
import json
import sys

import torch

from pdserve.engine.kv_transfer.transport import create_transport
from pdserve.engine.kv_transfer.transport.shm import allocate_shm_tensor

# [num_layers, K|V, num_blocks, block_size, kv_heads, head_dim]: 4 KiB per block piece.
KV_SHAPE = (2, 2, 8, 16, 2, 64)
KV_DTYPE = torch.float16


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


def reply(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
