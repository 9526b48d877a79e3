"""The engine command line follows the cluster spec; restarts back off and reset."""

from __future__ import annotations

from pdserve.api.manifest import default_cluster
from pdserve.nodeagent.engine_args import build_engine_argv, with_role
from pdserve.nodeagent.process import Backoff


def test_argv_from_the_default_cluster():
    argv = build_engine_argv(default_cluster(), "decode", ["--threads", "1"])
    flags = dict(zip(argv[4::2], argv[5::2], strict=False))
    assert argv[3] == "engine" and argv[-2:] == ["--threads", "1"]
    assert flags["--model"] == "tiny" and flags["--role"] == "decode" and flags["--port"] == "0"
    assert flags["--kv-transport"] == "tcp" and flags["--kv-cache-bytes"] == str(256 * 2**20)
    assert with_role(argv, "hybrid")[argv.index("--role") + 1] == "hybrid"


def test_backoff_doubles_up_to_the_cap():
    b = Backoff(base_s=0.5, max_s=3.0)
    assert [b.delay_s(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
