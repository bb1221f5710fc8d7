"""Regenerate the committed gRPC stubs from recover.proto.

Run `python -m recover.proto.generate` after editing the .proto; the test
suite fails while the committed stubs differ from what this produces. The
.proto is compiled from a temporary `recover/proto/` tree so the generated
imports read `from recover.proto import recover_pb2` (the installed layout).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILE = "recover.proto"
GENERATED = ("recover_pb2.py", "recover_pb2.pyi", "recover_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Compile recover.proto into `out_dir`; return the generated files."""
    from grpc_tools import protoc  # dev/test dependency only

    with tempfile.TemporaryDirectory() as tmp:
        package_dir = Path(tmp) / "recover" / "proto"
        package_dir.mkdir(parents=True)
        shutil.copy(PROTO_DIR / PROTO_FILE, package_dir / PROTO_FILE)
        include = Path(protoc.__file__).parent / "_proto"
        rc = protoc.main([
            "grpc_tools.protoc",
            f"-I{tmp}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"recover/proto/{PROTO_FILE}",
        ])
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in GENERATED:
            target = out_dir / name
            shutil.copy(package_dir / name, target)
            written.append(target)
        return written


def main() -> int:
    for path in generate(PROTO_DIR):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
