"""Bad peers and bad descriptors: a clear error before any byte moves, nothing leaked."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import torch

from pdserve.api.sampling import SamplingParams
from pdserve.engine.kv_transfer import messages
from pdserve.engine.kv_transfer.layout import KVLayout
from pdserve.engine.kv_transfer.params import KVTransferParams
from pdserve.engine.kv_transfer.transport.grants import WriteGrants
from pdserve.engine.kv_transfer.transport.tcp import TcpTransport
from tests.unit.engine.pd_harness import assert_all_free, make_engine, run_until_idle, submit_pair

PROMPT = list(range(1, 30))
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def test_incompatible_layouts_are_refused_before_any_byte_moves():
    p = make_engine("prefill", block_size=8)
    d = make_engine("decode", block_size=16)
    try:
        submit_pair(p, d, "mismatch", PROMPT, PARAMS, "push")
        outs = run_until_idle(p, d)
        for rid in ("p-mismatch", "d-mismatch"):
            last = outs[rid][-1]
            assert last.finish_reason == "error"
            assert "incompatible KV layout" in last.error and "block_size" in last.error
        assert p.stats().kv_transfer_bytes == 0
        assert_all_free(p, d)
    finally:
        p.close()
        d.close()


class FakeDecode:
    """A peer that speaks the control protocol by hand, to send descriptors an honest D never would."""

    def __init__(self, like: KVLayout, num_blocks: int = 4) -> None:
        self.buf = torch.zeros(like.num_layers * 2 * num_blocks * like.block_bytes, dtype=torch.uint8)
        self.layout = dataclasses.replace(like, num_blocks=num_blocks, base_addr=self.buf.data_ptr())
        self.transport = TcpTransport()
        self.transport.register_memory(self.layout.base_addr, self.layout.region_bytes)

    def send(self, peer: str, kind: str, **fields) -> None:
        self.transport.notify(peer, messages.encode(kind, self.transport.endpoint, **fields))

    def received(self, kind: str, timeout_s: float = 5.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for _, raw, _ in self.transport.recv_notifications():
                msg = messages.decode(raw)
                if msg["t"] == kind:
                    return msg
            time.sleep(0.01)
        raise TimeoutError(kind)


def run_prefill_against(fake: FakeDecode, p, reserve_blocks, expect: str, hello_layout=None):
    fake.send(p.connector.endpoint, "HELLO", layout=(hello_layout or fake.layout).to_dict())
    p.add_request("p-bad", PROMPT, PARAMS, kv_transfer=KVTransferParams(
        "prefill", "push", "x-bad", fake.transport.endpoint))
    fake.send(p.connector.endpoint, "RESERVE", x="x-bad", blocks=reserve_blocks)
    outs = run_until_idle(p)
    last = outs["p-bad"][-1]
    assert last.finish_reason == "error" and expect in last.error, last.error
    assert_all_free(p)
    return last


def test_reserve_naming_memory_outside_the_peer_is_refused():
    p = make_engine("prefill", block_size=8)
    fake = FakeDecode(p.connector.layout)
    try:
        # 29 tokens need 4 blocks; block 1000 lies far outside the fake D's region.
        run_prefill_against(fake, p, [0, 1, 2, 1000], "outside the peer registered memory")
        assert (fake.buf == 0).all()  # not one byte landed
    finally:
        p.close()
        fake.transport.close()


def test_reserve_with_the_wrong_number_of_blocks_is_refused():
    p = make_engine("prefill", block_size=8)
    fake = FakeDecode(p.connector.layout)
    try:
        run_prefill_against(fake, p, [0, 1], "RESERVE names 2 blocks, 4 needed")
        assert fake.received("FAILED")["x"] == "x-bad"
    finally:
        p.close()
        fake.transport.close()


def test_wrong_compatibility_hash_is_refused():
    p = make_engine("prefill", block_size=8)
    fake = FakeDecode(p.connector.layout)
    forged = dataclasses.replace(fake.layout, dtype="bfloat16")
    try:
        fake.send(p.connector.endpoint, "HELLO",
                  layout={**forged.to_dict(), "compat_hash": fake.layout.compat_hash})
        run_prefill_against(fake, p, [0, 1, 2, 3], "incompatible KV layout",
                            hello_layout=forged)
        assert fake.received("HELLO_REJECT")["reason"]
        assert (fake.buf == 0).all()
    finally:
        p.close()
        fake.transport.close()


class FakeConn:
    def __init__(self) -> None:
        self.cut = threading.Event()


def test_write_grants_fence_a_landing_write():
    grants = WriteGrants()
    grants.grant("p1", "x1", np.array([[1000, 100], [1100, 100]]))
    grants.grant("p1", "x2", np.array([[5000, 100]]))
    addrs, lengths = np.array([1000]), np.array([200])  # spans two granted blocks
    conn = FakeConn()
    token = grants.begin_write("p1", addrs, lengths, conn)
    assert isinstance(token, int)
    assert "outside" in grants.begin_write("p1", np.array([1150]), np.array([100]), conn)
    assert "no write grant" in grants.begin_write("p2", addrs, lengths, conn)

    def reader_stops_when_cut():  # plays the connection thread
        conn.cut.wait(5)
        grants.end_write(token)

    t = threading.Thread(target=reader_stops_when_cut)
    t.start()
    assert grants.revoke("x1", cut=lambda c: c.cut.set(), timeout_s=5)  # cut, then waited
    t.join()
    assert conn.cut.is_set()
    assert "outside" in grants.begin_write("p1", addrs, lengths, conn)  # x1 is gone
    assert isinstance(grants.begin_write("p1", np.array([5000]), np.array([100]), conn), int)
