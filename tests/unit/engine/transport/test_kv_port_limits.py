"""The KV port against peers that are not engines: bad HELLOs, slow ones, too many, silent.

A ``kv_peer`` child serves the tcp transport with tight limits; the test opens raw
sockets to it and speaks (or mangles) the wire protocol by hand. Each refusal is
answered REFUSE (or just closed), logged once with its reason (then at most once per
host and reason every 30 s), and never leaves a traceback in the peer's log. One peer
serves the whole module and is reaped at the end.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from pdserve.engine.kv_transfer.transport import wire
from tests.unit.engine.transport.kv_peer import Peer

TOKEN = "s3cret"
HANDSHAKE_S = 1.0
IDLE_S = 1.0
SLACK_S = 1.5
LIMITS = {"max_handshakes_per_host": 4, "handshake_timeout_s": HANDSHAKE_S,
          "idle_timeout_s": IDLE_S, "refusal_log_every_s": 30.0}


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    peer = Peer("tcp", tmp_path_factory.mktemp("limits"), auth_token=TOKEN, timeout_s=0.5,
                limits=LIMITS)
    yield peer
    assert peer.reap() == 0
    assert "Traceback" not in peer.log_path.read_text()


def dial(peer: Peer) -> socket.socket:
    host, _, port = peer.endpoint.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=HANDSHAKE_S + SLACK_S)


def hello(sock: socket.socket, body: bytes) -> None:
    sock.sendall(wire.HEADER.pack(wire.OP_HELLO, 0, len(body)) + body)


def answer(sock: socket.socket) -> tuple[int | None, bytes, float]:
    """The peer's one frame (None if it just closed) and when the connection ended."""
    started = time.monotonic()
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    ended_s = time.monotonic() - started
    sock.close()
    if not data:
        return None, b"", ended_s
    op, _, length = wire.HEADER.unpack(data[:wire.HEADER.size])
    return op, data[wire.HEADER.size:wire.HEADER.size + length], ended_s


def wait_for_log(peer: Peer, text: str, timeout_s: float = 5.0) -> str:
    deadline = time.monotonic() + timeout_s
    while text not in (log := peer.log_path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert text in log, log
    return log


@pytest.mark.parametrize("body", [b"[1, 2]", b'"token"', b"42", b"null", b"{oops", b"\xff\xfe",
                                  b'{"token": 5}', b'{"endpoint": ["a"]}'])
def test_malformed_hello_is_refused_with_its_reason(peer, body):
    sock = dial(peer)
    hello(sock, body)
    op, reason, _ = answer(sock)
    assert op == wire.OP_REFUSE and reason.startswith(b"malformed HELLO"), reason
    log = wait_for_log(peer, "refused KV connection from 127.0.0.1: malformed HELLO")
    assert log.count("malformed HELLO") == 1  # once per host and reason per 30 s


def test_a_first_frame_other_than_hello_is_refused_before_its_body(peer):
    sock = dial(peer)
    sock.sendall(wire.HEADER.pack(wire.OP_WRITE, 7, 64 << 20))
    op, reason, ended_s = answer(sock)
    assert op == wire.OP_REFUSE and b"unexpected frame" in reason
    assert ended_s < SLACK_S  # refused from the header alone
    wait_for_log(peer, "unexpected frame: op 4 where HELLO was expected")


def test_slow_hello_is_cut_at_the_handshake_deadline(peer):
    socks = [dial(peer) for _ in range(3)]
    socks[0].sendall(wire.HEADER.pack(wire.OP_HELLO, 0, 100)[:5])  # half a header
    socks[1].sendall(wire.HEADER.pack(wire.OP_HELLO, 0, 100) + b"{")  # a header, a byte of body
    for sock in socks:  # the third sends nothing at all
        op, _, ended_s = answer(sock)
        assert op is None and ended_s <= HANDSHAKE_S + SLACK_S, ended_s
    wait_for_log(peer, "handshake timeout")


def authenticate(sock: socket.socket) -> dict:
    """HELLO with the cluster's token; returns the WELCOME's body."""
    hello(sock, json.dumps({"token": TOKEN, "endpoint": "127.0.0.1:1"}).encode())
    op, _, body = wire.recv_frame(sock, wire.WELCOME_LIMITS, 2.0)
    assert op == wire.OP_WELCOME, body
    return json.loads(body)


def hang_up(socks: list[socket.socket]) -> None:
    """Close each connection and wait until the port closed its side: its thread ended
    and no longer counts against any cap."""
    for sock in socks:
        sock.shutdown(socket.SHUT_WR)
    for sock in socks:
        answer(sock)


def test_handshake_cap_refuses_the_next_one_and_logs_it_once(peer):
    held = [dial(peer) for _ in range(LIMITS["max_handshakes_per_host"])]
    time.sleep(0.2)  # all accepted
    for _ in range(3):
        op, reason, ended_s = answer(dial(peer))
        assert op == wire.OP_REFUSE and b"too many KV handshakes from 127.0.0.1" in reason
        assert ended_s < SLACK_S
    log = wait_for_log(peer, "connection cap")
    assert log.count("connection cap") == 1  # rate-limited: one line per reason and host
    hang_up(held)
    sock = dial(peer)
    assert "regions" in authenticate(sock)
    hang_up([sock])


def test_authenticated_peers_of_one_host_are_not_held_to_the_handshake_cap(peer):
    """Many engines on one host (local mode, a big node) each link to this port: once
    authenticated they free their host's handshake slots, so more cluster members than
    the cap stay connected, and the cap still holds for connections mid-handshake."""
    members = []
    for _ in range(3 * LIMITS["max_handshakes_per_host"]):  # one after the other, as engines start
        members.append(sock := dial(peer))
        authenticate(sock)
    pending = [dial(peer) for _ in range(LIMITS["max_handshakes_per_host"])]
    time.sleep(0.2)  # all accepted
    op, reason, _ = answer(dial(peer))
    assert op == wire.OP_REFUSE and b"too many KV handshakes" in reason
    for sock in members:  # every member's connection still serves
        sock.sendall(wire.HEADER.pack(wire.OP_FENCE, 9, 0))
        assert wire.recv_frame(sock, {wire.OP_ACK: 0}, 2.0)[:2] == (wire.OP_ACK, 9)
    hang_up(members + pending)


def test_authenticated_peer_is_closed_after_idling_or_sending_garbage(peer):
    silent, noisy = dial(peer), dial(peer)
    for sock in (silent, noisy):
        hello(sock, json.dumps({"token": TOKEN}).encode())
        assert wire.recv_frame(sock, wire.WELCOME_LIMITS, 2.0)[0] == wire.OP_WELCOME
    noisy.sendall(wire.HEADER.pack(99, 0, 0))
    op, _, ended_s = answer(noisy)
    assert op is None and ended_s < SLACK_S
    wait_for_log(peer, "closed KV connection from 127.0.0.1: unexpected frame: op 99")
    op, _, ended_s = answer(silent)
    assert op is None and ended_s <= IDLE_S + 0.5 + SLACK_S  # checked once per timeout_s
    wait_for_log(peer, "closed KV connection from 127.0.0.1: idle timeout")
