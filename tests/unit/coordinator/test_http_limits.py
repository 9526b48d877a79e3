"""The HTTP server lets no connection sit open for nothing: idle, with half-sent
headers, after its last response, or with a half-sent body. Driven with raw sockets."""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import time

import pytest

from pdserve.coordinator.cli import add_arguments, settings_from_args
from pdserve.coordinator.http_server import MAX_HEADER_BYTES, build_config
from tests.unit.coordinator.harness import serve

LIMITS = {"http_header_timeout_s": 0.5, "http_keep_alive_s": 0.5, "http_body_timeout_s": 0.5}


@pytest.fixture
def app(loop, stubs):
    with serve(loop, [stubs()], **LIMITS) as app:
        yield app


def connect(app) -> socket.socket:
    host, port = app.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(5)  # far beyond every limit: a recv that waits this long fails the test
    return sock


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed."""
    start, data = time.monotonic(), b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - start


def test_a_connection_that_sends_nothing_is_closed(app):
    with connect(app) as sock:
        data, after_s = read_until_closed(sock)
    assert data == b"" and after_s < 2


def test_half_sent_headers_are_answered_408_and_closed(app):
    with connect(app) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
        data, after_s = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408") and after_s < 2


def test_an_idle_keep_alive_connection_is_closed_after_its_response(app):
    with connect(app) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data, after_s = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 200") and after_s < 2


def test_a_half_sent_body_is_answered_408_and_closed(app):
    with connect(app) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")
        data, after_s = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408") and b"body_timeout" in data and after_s < 2


def test_headers_past_the_size_limit_are_refused(app):
    with connect(app) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 1))
        data, _ = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 431")


def test_a_busy_connection_is_not_cut(app):
    """The limits bound waiting for a request, never a connection in use."""
    host, port = app.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        sockets = set()
        for _ in range(4):  # each request within the keep-alive time: one connection throughout
            conn.request("GET", "/health")
            assert conn.getresponse().read() == b'{"status":"ok","detail":{}}'
            sockets.add(id(conn.sock))
            time.sleep(0.3)
        assert len(sockets) == 1
    finally:
        conn.close()


def test_the_limits_are_coordinator_flags():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = settings_from_args(parser.parse_args([]))
    assert (defaults.http_keep_alive_s, defaults.http_header_timeout_s,
            defaults.http_body_timeout_s, defaults.max_connections) == (5.0, 5.0, 30.0, 4096)
    given = settings_from_args(parser.parse_args([
        "--http-keep-alive-s", "2", "--http-header-timeout-s", "3", "--http-body-timeout-s", "4",
        "--max-connections", "100"]))
    config = build_config(object(), given)
    assert (config.timeout_keep_alive, config.limit_concurrency) == (2.0, 100)
    assert config.http.header_timeout_s == 3.0 and given.http_body_timeout_s == 4.0


def test_a_pipelined_keep_alive_connection_gets_every_answer_whole(app):
    sock = connect(app)
    request = (b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n") * 3
    sock.sendall(request)
    got = b""
    while got.count(b'{"status":"ok"') < 3:
        chunk = sock.recv(65536)
        assert chunk, got
        got += chunk
    assert got.count(b"HTTP/1.1 200 OK") == 3
    sock.close()


def read_answers(sock: socket.socket, count: int) -> list[tuple[bytes, dict[bytes, bytes], bytes]]:
    """``count`` whole responses (status line, headers, body by content-length) read off
    ``sock``; fails if the connection closes first."""
    got, answers = b"", []
    while len(answers) < count:
        head_end = got.find(b"\r\n\r\n")
        if head_end >= 0:
            status, *lines = got[:head_end].split(b"\r\n")
            headers = dict(line.split(b": ", 1) for line in lines)
            length = int(headers[b"content-length"])
            if len(got) >= head_end + 4 + length:
                answers.append((status, headers, got[head_end + 4:head_end + 4 + length]))
                got = got[head_end + 4 + length:]
                continue
        chunk = sock.recv(65536)
        assert chunk, (answers, got)
        got += chunk
    assert got == b""  # nothing beyond the answers
    return answers


COMPLETION = (b'POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n'
              b'content-length: 43\r\n%s\r\n{"model": "tiny", "prompt": "hi", "n": 1}  ')


def test_pipelined_completions_are_answered_whole_and_in_order(app):
    """Completions pipelined on one keep-alive connection: each answer whole (head and
    body by its content-length), the server's own headers there, the connection kept
    for the next."""
    with connect(app) as sock:
        sock.sendall(COMPLETION % b"" * 3)
        answers = read_answers(sock, 3)
        ids = set()
        for status, headers, body in answers:
            assert status == b"HTTP/1.1 200 OK"
            assert headers[b"content-type"] == b"application/json"
            assert {b"date", b"server", b"x-request-id"} <= headers.keys()
            assert b"connection" not in headers
            answer = json.loads(body)
            assert answer["object"] == "text_completion" and answer["choices"][0]["text"]
            assert answer["id"].endswith(headers[b"x-request-id"].decode())
            ids.add(answer["id"])
        assert len(ids) == 3
        sock.sendall(COMPLETION % b"")  # still open: a fourth on the same connection
        assert read_answers(sock, 1)[0][0] == b"HTTP/1.1 200 OK"


def test_a_completion_asked_to_close_is_answered_then_closed(app):
    with connect(app) as sock:
        sock.sendall(COMPLETION % b"connection: close\r\n")
        (status, headers, body), = read_answers(sock, 1)
        assert status == b"HTTP/1.1 200 OK" and headers[b"connection"] == b"close"
        assert json.loads(body)["choices"]
        assert sock.recv(65536) == b""  # closed by the server, nothing more sent
