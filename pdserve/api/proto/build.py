"""Regenerate the Python modules from the .proto files in this directory.

``python -m pdserve.api.proto.build`` writes ``*_pb2.py``, ``*_pb2.pyi`` and
``*_pb2_grpc.py`` next to each proto; ``build(out_dir)`` writes them elsewhere so a
test can compare the committed copies with a fresh build.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
ROOT = PROTO_DIR.parents[2]  # the directory holding the ``pdserve`` package


def build(out_dir: Path = ROOT) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted(PROTO_DIR.glob("*.proto"))
    rel = [str(p.relative_to(ROOT)) for p in protos]
    args = ["protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *rel]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return protos


if __name__ == "__main__":
    build()
    sys.exit(0)
