"""The `recover.v1` gRPC API: messages and stubs generated from recover.proto."""

from recover.proto import recover_pb2 as pb
from recover.proto import recover_pb2_grpc as rpc

__all__ = ["pb", "rpc"]
