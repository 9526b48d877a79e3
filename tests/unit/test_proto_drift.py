"""The committed generated gRPC modules match a fresh build of the .proto files."""

from pathlib import Path

from pdserve.api.proto.build import PROTO_DIR, ROOT, build


def test_generated_modules_are_up_to_date(tmp_path: Path):
    protos = build(tmp_path)
    assert protos
    for proto in protos:
        stem = proto.stem
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            rel = (PROTO_DIR / f"{stem}{suffix}").relative_to(ROOT)
            fresh = (tmp_path / rel).read_text()
            committed = (ROOT / rel).read_text()
            assert fresh == committed, f"{rel} is stale: run `make proto`"
