"""A real Mooncake Store master for tests, started as users start it (``pdserve kv-pool``)."""

from __future__ import annotations

import socket
import time

from pdserve.runtime.kv_pool_master import READY_LINE
from tests.etcd import free_port
from tests.procs import PDSERVE, Proc


class PoolMaster:
    def __init__(self) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc: Proc | None = None

    def start(self) -> PoolMaster:
        self.proc = Proc([*PDSERVE, "kv-pool", "--port", str(self.port),
                          "--metrics-port", str(self.metrics_port)])
        self.proc.wait_for(READY_LINE, timeout_s=30)
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
