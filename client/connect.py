"""Channels to a job's controller: one address, or the leader among several.

Shared by `recover status|events|summary|stop|...`, the `recover run` launcher and the
benchmarks, which all talk to a running controller the same way.
"""

from __future__ import annotations

import time

import grpc

from recover.common.explain import explain_transport
from recover.common.security import Security, from_values
from recover.common.security import channel as secure_channel
from recover.proto import pb, rpc


class ControllerUnreachable(Exception):
    """Nobody answers at the controller address."""


def connect(address: str, timeout_s: float = 5.0, security: Security | None = None
            ) -> tuple[grpc.Channel, rpc.ControlStub]:
    """A channel to the controller at `address`, with `security` (None: from the
    RECOVER_TLS_* and RECOVER_TOKEN_FILE environment)."""
    security = security if security is not None else from_values()
    channel = secure_channel(address, security)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        why = transport_error(channel, security.tls)
        channel.close()
        raise ControllerUnreachable(
            f"no controller answers at {address} (waited {timeout_s:.0f}s)"
            + (f": {why}" if why else "")) from None
    return channel, rpc.ControlStub(channel)


def transport_error(channel: grpc.Channel, tls: bool) -> str:
    """Why a channel does not connect, as gRPC saw it (a TLS handshake that failed...)."""
    try:
        rpc.ControlStub(channel).Status(pb.StatusRequest(), timeout=1.0)
    except grpc.RpcError as exc:
        if exc.code() is grpc.StatusCode.UNAVAILABLE:  # type: ignore[attr-defined]
            return explain_transport(exc.details() or "", tls)  # type: ignore[attr-defined]
    return ""


def connect_leader(addresses: str, timeout_s: float = 5.0, security: Security | None = None
                   ) -> tuple[grpc.Channel, rpc.ControlStub]:
    """Connect to the leading controller among comma-separated `addresses`.

    A standby names the leader it sees, which is tried too. With no leader
    reachable, the first controller that answers (a standby) is returned.
    """
    candidates = [a.strip() for a in addresses.split(",") if a.strip()]
    if len(candidates) == 1:
        return connect(candidates[0], timeout_s, security)
    deadline = time.monotonic() + timeout_s
    while True:  # every address, again, until one answers or the time is up
        fallback: tuple[grpc.Channel, rpc.ControlStub] | None = None
        for address in list(candidates):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                channel, stub = connect(address, min(remaining, 2.0), security)
                status = stub.Status(pb.StatusRequest(), timeout=min(remaining, 2.0))
            except (ControllerUnreachable, grpc.RpcError):
                continue
            if status.role != "standby":
                if fallback is not None:
                    fallback[0].close()
                return channel, stub
            if status.leader and status.leader not in candidates:
                candidates.append(status.leader)
            if fallback is None:
                fallback = (channel, stub)
            else:
                channel.close()
        if fallback is not None:
            return fallback
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    raise ControllerUnreachable(f"no controller answers at {addresses} (waited {timeout_s:.0f}s)")
