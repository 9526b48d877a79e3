"""The committed generated gRPC modules match a fresh build of the .proto files.

The build runs in a process of its own: protoc (grpc_tools) brings its own protobuf
library, which can clash with the native libraries other tests load into this one."""

import re
import subprocess
import sys
from pathlib import Path

from pdserve.api.proto.build import PROTO_DIR, ROOT

# What the generator stamps with its own version (grpcio-tools' release, the protobuf it
# bundles): a newer patch release of the tool is not a change of the .proto files.
TOOL_STAMPS = (re.compile(r"^GRPC_GENERATED_VERSION = .*$", re.M),
               re.compile(r"^# Protobuf Python Version: .*$", re.M),
               re.compile(r"ValidateProtobufRuntimeVersion\([^)]*\)"))


def without_tool_stamps(text: str) -> str:
    for stamp in TOOL_STAMPS:
        text = stamp.sub("<stamp>", text)
    return text


def test_tool_stamps_are_all_that_is_left_out():
    committed = (PROTO_DIR / "controller_pb2_grpc.py").read_text()
    bumped = re.sub(r"GRPC_GENERATED_VERSION = '[^']*'", "GRPC_GENERATED_VERSION = '9.9.9'", committed)
    assert bumped != committed and without_tool_stamps(bumped) == without_tool_stamps(committed)
    edited = committed.replace("def add_", "def add_x", 1)
    assert without_tool_stamps(edited) != without_tool_stamps(committed)


def test_generated_modules_are_up_to_date(tmp_path: Path):
    subprocess.run([sys.executable, "-c", "import sys; from pdserve.api.proto.build import build; "
                    "build(__import__('pathlib').Path(sys.argv[1]))", str(tmp_path)],
                   check=True, cwd=ROOT, timeout=120)
    protos = sorted(PROTO_DIR.glob("*.proto"))
    assert protos
    for proto in protos:
        stem = proto.stem
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            rel = (PROTO_DIR / f"{stem}{suffix}").relative_to(ROOT)
            fresh = (tmp_path / rel).read_text()
            committed = (ROOT / rel).read_text()
            assert without_tool_stamps(fresh) == without_tool_stamps(committed), \
                f"{rel} is stale: run `make proto`"
