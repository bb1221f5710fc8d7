"""The committed gRPC stubs are exactly what recover.proto compiles to."""

from __future__ import annotations

from pathlib import Path

import pytest

from recover.proto import generate as gen

try:
    from grpc_tools import protoc  # noqa: F401  (what generate() needs)
except ImportError:
    HAVE_GRPC_TOOLS = False
else:
    HAVE_GRPC_TOOLS = True

needs_grpc_tools = pytest.mark.skipif(
    not HAVE_GRPC_TOOLS,
    reason="grpc_tools is not installed (pip install grpcio-tools, the `test` extra); "
           "cannot regenerate the stubs to compare them")

FIX = "run python -m recover.proto.generate"


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("stubs")
    written = gen.generate(out)
    return {path.name: path for path in written}


@needs_grpc_tools
def test_generate_writes_every_stub(regenerated):
    assert sorted(regenerated) == sorted(gen.GENERATED)
    for path in regenerated.values():
        assert path.stat().st_size > 0


@needs_grpc_tools
@pytest.mark.parametrize("name", gen.GENERATED)
def test_committed_stub_matches_proto(regenerated, name):
    committed = gen.PROTO_DIR / name
    assert committed.exists(), f"{committed} is missing: {FIX}"
    assert regenerated[name].read_bytes() == committed.read_bytes(), (
        f"proto/{name} is stale against proto/{gen.PROTO_FILE}: {FIX}")


@needs_grpc_tools
def test_stubs_import_the_installed_package_layout(regenerated):
    grpc_stub = regenerated["recover_pb2_grpc.py"].read_text()
    assert "from recover.proto import recover_pb2" in grpc_stub


def test_generated_from_the_committed_proto():
    # The loaded module describes the same file the generator compiles.
    from recover.proto import pb

    assert pb.DESCRIPTOR.name == f"recover/proto/{gen.PROTO_FILE}"
    assert pb.DESCRIPTOR.package == "recover.v1"
    proto_text = (gen.PROTO_DIR / gen.PROTO_FILE).read_text()
    for message in pb.DESCRIPTOR.message_types_by_name:
        assert f"message {message} " in proto_text
