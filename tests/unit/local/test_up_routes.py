"""``pdserve up`` says it is up once the Coordinator routes (its /ready), not when the
Controller's view is complete: before, a request sent on "pdserve is up" could find no
checked pair. ``coordinator_routes`` reads /ready and, when it is not ready, says why in
the Coordinator's own words."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pdserve.local.up import coordinator_routes
from pdserve.runtime.ports import free_ports


class Ready(BaseHTTPRequestHandler):
    status, body = 200, b'{"status": "ready", "detail": {"pd": "ok"}}'

    def do_GET(self):
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def serve():
    servers = []

    def start(status: int, body: bytes) -> str:
        handler = type("H", (Ready,), {"status": status, "body": body})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_ready_routes(serve):
    assert coordinator_routes(serve(200, Ready.body)) == (True, "")


def test_not_ready_says_why_in_the_coordinators_words(serve):
    body = json.dumps({"status": "not ready", "detail": {"pd": "no usable prefill/decode pair yet"}}).encode()
    assert coordinator_routes(serve(503, body)) == (False, "no usable prefill/decode pair yet")
    assert coordinator_routes(serve(503, b"<html>busy</html>")) == (False, "/ready answered 503")


def test_a_coordinator_not_listening_yet_is_not_ready():
    port = free_ports("127.0.0.1", 1)[0]
    routes, why = coordinator_routes(f"http://127.0.0.1:{port}")
    assert not routes and why.startswith("not answering")
