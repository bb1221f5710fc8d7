"""The controller's door: is it a message at all, who is calling, may they call this.

Every RPC passes here before it reaches the job. Bytes that are not the message
an RPC expects are answered INVALID_ARGUMENT (no internal text); a caller without
the credentials this controller requires is answered UNAUTHENTICATED, one whose
roles do not cover the RPC PERMISSION_DENIED (authz.py decides). Each refusal is
counted and logged by the `reject` callback: never a crash, and nothing of the job
is touched.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from recover.common.security import ANONYMOUS, Authenticator, Identity
from recover.controller import authz
from recover.proto import pb


class Malformed:
    """What a request deserializes to when its bytes are not the expected message."""

    def __init__(self, expected: str) -> None:
        self.expected = expected


def _lenient(message_type: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except (DecodeError, ValueError, RuntimeError):
            return Malformed(message_type.DESCRIPTOR.name)
    return parse


_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class SerializedOnce:
    """A response serializer for a message the leader sends to many streams in a row: a new
    generation's view (it lists every member and the plan) or a commit goes to every agent
    of a direct session, and gRPC serializes each stream's copy on its own: at 12,500
    agents, N serializations of a message of size N held the leader for 3.3 s per loss
    (BENCHMARKS.md 5). The same object (and the same term, the one field `send` sets per
    message) is serialized once; the few most recent are kept, each with a reference that
    keeps its `id` from being reused."""

    def __init__(self, keep: int = 16) -> None:
        self._keep = keep
        self._recent: OrderedDict[int, tuple[Any, int, bytes]] = OrderedDict()
        self.serialized = 0
        self.reused = 0

    def __call__(self, message: Any) -> bytes:
        key, term = id(message), getattr(message, "term", 0)
        known = self._recent.get(key)
        if known is not None and known[0] is message and known[1] == term:
            self.reused += 1
            return known[2]
        data: bytes = message.SerializeToString()
        self.serialized += 1
        self._recent[key] = (message, term, data)
        if len(self._recent) > self._keep:
            self._recent.popitem(last=False)
        return data


def add_service(server: grpc.aio.Server, servicer: object, service_name: str,
                serializers: dict[str, Callable[[Any], bytes]] | None = None) -> None:
    """Register `servicer`'s methods for the service named in recover.proto, with
    deserializers that turn bad bytes into `Malformed` rather than an internal error (and
    `serializers` for some methods' responses, by name)."""
    service = pb.DESCRIPTOR.services_by_name[service_name]
    handlers = {}
    for method in service.methods:
        request, response = (getattr(pb, method.input_type.name),
                             getattr(pb, method.output_type.name))
        make = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(getattr(servicer, method.name),
                                     request_deserializer=_lenient(request),
                                     response_serializer=(serializers or {}).get(
                                         method.name, response.SerializeToString))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        service.full_name, handlers),))


Reject = Callable[[authz.Verdict], None]


class Gate:
    """Authentication and per-RPC authorization, for the controller's servicers."""

    def __init__(self, authenticator: Authenticator | None = None) -> None:
        self.authenticator = authenticator
        self.reject: Reject = lambda verdict: None
        """Counts and logs a refusal (set by the server: the coordinator's events)."""

    def identify(self, context: grpc.aio.ServicerContext) -> Identity | str:
        if self.authenticator is None:
            return ANONYMOUS
        return self.authenticator.identify(context.auth_context(),
                                           context.invocation_metadata() or ())

    async def admit(self, context: grpc.aio.ServicerContext, method: str,
                    request: object = None) -> Identity:
        """The caller's identity, or the call is aborted with the reason."""
        if isinstance(request, Malformed):
            await self.refuse(context, authz.Verdict(
                False, f"{method}: the request is not a valid {request.expected} message",
                authz.Reason.MALFORMED), grpc.StatusCode.INVALID_ARGUMENT)
        identity = self.identify(context)
        if isinstance(identity, str):
            await self.refuse(context, authz.Verdict(False, f"{method}: {identity}",
                                                     authz.Reason.UNAUTHENTICATED),
                              grpc.StatusCode.UNAUTHENTICATED)
        assert not isinstance(identity, str)
        verdict = authz.may_call(method, identity)
        if not verdict.allowed:
            await self.refuse(context, verdict, grpc.StatusCode.PERMISSION_DENIED)
        return identity

    async def refuse(self, context: grpc.aio.ServicerContext, verdict: authz.Verdict,
                     code: grpc.StatusCode) -> None:
        self.reject(verdict)
        await context.abort(code, verdict.reason)
