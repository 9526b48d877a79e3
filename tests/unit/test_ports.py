"""Ports handed to processes that bind them later lie outside the kernel's ephemeral
range, where an outgoing connection cannot take them meanwhile."""

from __future__ import annotations

import random
import socket

from pdserve.runtime import ports


def test_ports_lie_outside_the_ephemeral_range_are_distinct_and_bind():
    low, high = ports.ephemeral_range()
    chosen = [p for _ in range(20) for p in ports.free_ports("127.0.0.1", 3)]
    assert all(not low <= p <= high for p in chosen), chosen
    assert all(p >= ports.LOWEST for p in chosen)
    for i in range(0, len(chosen), 3):
        assert len(set(chosen[i:i + 3])) == 3
    with socket.socket() as s:
        s.bind(("127.0.0.1", chosen[-1]))


def test_a_port_in_use_is_passed_over(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        # Only two candidates: the busy one and the next.
        monkeypatch.setattr(ports, "LOWEST", taken)
        got = ports.free_ports("127.0.0.1", 1, rng=random.Random(0), ephemeral=(taken + 2, 65535))
        assert got[0] != taken  # taken + 1, or the kernel's choice where that one is busy too


def test_with_no_port_outside_the_range_the_kernel_chooses():
    got = ports.free_ports("127.0.0.1", 2, ephemeral=(1, 65535))
    assert len(set(got)) == 2 and all(p > 0 for p in got)


def test_the_ephemeral_range_is_read_from_the_kernel(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ports.ephemeral_range(f) == (40000, 50000)
    assert ports.candidates(40000, 50000) == [range(ports.LOWEST, 40000), range(50001, 65536)]
    assert ports.ephemeral_range(tmp_path / "absent") == (32768, 60999)
