"""The committed generated gRPC modules match a fresh build of the .proto files.

The build runs in a process of its own: protoc (grpc_tools) brings its own protobuf
library, which can clash with the native libraries other tests load into this one."""

import subprocess
import sys
from pathlib import Path

from pdserve.api.proto.build import PROTO_DIR, ROOT


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
            assert fresh == committed, f"{rel} is stale: run `make proto`"
