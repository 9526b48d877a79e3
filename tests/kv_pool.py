"""A real Mooncake Store master for tests (the binary the Mooncake wheel ships)."""

from __future__ import annotations

import shutil
import socket
import sys
import time
from pathlib import Path

from tests.etcd import free_port
from tests.procs import Proc


def master_binary() -> str:
    found = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    if not Path(found).exists():
        raise AssertionError("mooncake_master is missing: make test installs the Mooncake wheel")
    return found


class PoolMaster:
    def __init__(self) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc: Proc | None = None

    def start(self) -> PoolMaster:
        self.proc = Proc([master_binary(), f"--rpc_port={self.port}",
                          f"--metrics_port={self.metrics_port}", "--rpc_address=127.0.0.1",
                          "--default_kv_lease_ttl=100"])
        self.proc.wait_for(r"Master service started on port", timeout_s=30)
        deadline = time.monotonic() + 10
        while True:  # it logs that line just before it listens
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                assert time.monotonic() < deadline, "mooncake_master does not listen"
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None
