"""Moving training state between two workers over one TCP connection.

A join streams a donor's state to a joiner while the donor keeps training:
a snapshot taken at a committed step, then the reduced gradient of every step
committed since, which the joiner applies as the donor did (DESIGN.md "Joins").
The joiner listens (it is idle), the donor connects; the controller hands the
donor the joiner's address and a one-time token that the joiner checks before
reading anything else. Frames are typed: a header, a protobuf message, then
the raw bytes of the tensors the message describes, received straight into
their destination (no pickle, no intermediate copy).

Sockets here are claimed from the generation groups' socket sweep
(`groups.gloo.exclude_sockets`): a join must not be cut by an aborted
allreduce of the donor, nor an allreduce by a failed join.
"""

from __future__ import annotations

import hmac
import socket
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from enum import IntEnum
from typing import Any

import torch
from google.protobuf.message import DecodeError, Message

from recover.proto import pb
from recover.trainer.groups import gloo
from recover.trainer.statewire import as_bytes, empty_tensors

MAGIC = b"RCVR"
HEADER = struct.Struct("<4sBQQ")  # magic, frame kind, message bytes, tensor bytes
MAX_MESSAGE_BYTES = 64 << 20
"""Largest frame message accepted: a state manifest is kilobytes; more is a broken peer."""
HELLO_MAX_BYTES = 4096
HELLO_TIMEOUT_S = 2.0
"""A connection must introduce itself this fast and this briefly, or it is dropped."""
POLL_S = 0.25
"""How often a waiting joiner looks up from its listening socket."""


class FrameKind(IntEnum):
    HELLO = 1
    """TransferHello: who connects, with the controller's token."""
    SNAPSHOT = 2
    """StateManifest + the state's tensors: the donor's state at a committed step."""
    STEP = 3
    """CatchUpStep + that step's reduced gradient, one tensor per gradient bucket."""
    END = 4
    """TransferEnd: the donor sent every step the joiner needs (or says why it stops)."""
    PREVIEW = 5
    """StateManifest without bytes: the snapshot's layout, sent just before the snapshot, so
    the joiner prepares the memory to receive it into (trainer/destinations.py)."""


MESSAGES: dict[FrameKind, type[Message]] = {
    FrameKind.HELLO: pb.TransferHello, FrameKind.SNAPSHOT: pb.StateManifest,
    FrameKind.STEP: pb.CatchUpStep, FrameKind.END: pb.TransferEnd,
    FrameKind.PREVIEW: pb.StateManifest,
}


class TransferError(Exception):
    """The transfer broke (peer gone, bad frame, wrong token); the message says how."""


class Stream:
    """One side of a transfer connection: typed frames out and in."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        gloo.exclude_sockets([sock])
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sent_bytes = 0
        self.received_bytes = 0

    def settimeout(self, seconds: float | None) -> None:
        self._sock.settimeout(seconds)

    def send(self, kind: FrameKind, message: Message, tensors: Sequence[torch.Tensor] = ()) -> None:
        payload = message.SerializeToString()
        cpu = [t.detach().to("cpu").contiguous() for t in tensors]
        total = sum(t.numel() * t.element_size() for t in cpu)
        try:
            self._sock.sendall(HEADER.pack(MAGIC, kind, len(payload), total) + payload)
            for t in cpu:
                self._sock.sendall(as_bytes(t))
        except OSError as exc:
            raise TransferError(f"sending a {kind.name} frame failed: {exc}") from None
        self.sent_bytes += HEADER.size + len(payload) + total

    def receive(self, max_message: int = MAX_MESSAGE_BYTES, max_tensor_bytes: int | None = None,
                into: Callable[[Any], Iterable[torch.Tensor]] | None = None,
                ) -> tuple[FrameKind, Message, list[torch.Tensor]]:
        """The next frame. `into` gives the tensors to receive its bytes into (else they
        land in fresh ones); it is asked only once the frame's sizes are checked."""
        magic, kind_value, size, total = HEADER.unpack(self._read_exactly(HEADER.size))
        if magic != MAGIC or kind_value not in FrameKind._value2member_map_:
            raise TransferError("not a ReCoVer transfer frame")
        if size > max_message:
            raise TransferError(f"a frame message of {size} bytes is too large")
        if max_tensor_bytes is not None and total > max_tensor_bytes:
            raise TransferError(f"a frame announcing {total} tensor bytes is too large")
        kind = FrameKind(kind_value)
        message = MESSAGES[kind]()
        try:
            message.ParseFromString(self._read_exactly(size))
        except DecodeError:
            raise TransferError(f"a {kind.name} frame's message does not parse") from None
        # A preview describes tensors that come with the snapshot after it, not with it.
        metas = () if kind is FrameKind.PREVIEW else getattr(message, "tensors", ())
        # Checked before anything is allocated: a hostile or broken peer must not make this
        # process allocate what its frame does not carry.
        if sum(m.nbytes for m in metas) != total:
            raise TransferError(f"a {kind.name} frame announces {total} tensor bytes, its "
                                "message describes another amount")
        try:
            tensors = list(into(message) if into is not None and metas else empty_tensors(metas))
        except (ValueError, RuntimeError) as exc:
            raise TransferError(f"a {kind.name} frame describes impossible tensors: {exc}"
                                ) from None
        if [t.numel() * t.element_size() for t in tensors] != [m.nbytes for m in metas]:
            raise TransferError(f"no room to receive a {kind.name} frame as described")
        for t in tensors:
            self._read_into(as_bytes(t))
        self.received_bytes += HEADER.size + size + total
        return kind, message, tensors

    def _read_exactly(self, n: int) -> bytes:
        buffer = bytearray(n)
        self._read_into(memoryview(buffer))
        return bytes(buffer)

    def _read_into(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            try:
                got = self._sock.recv_into(view[done:])
            except OSError as exc:
                raise TransferError(f"receiving failed: {exc}") from None
            if got == 0:
                raise TransferError("the peer closed the connection")
            done += got

    def close(self) -> None:
        gloo.include_sockets([self._sock])
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


class Listener:
    """The joiner's listening socket, open for its whole life (joins can be retried)."""

    def __init__(self, host: str) -> None:
        self._sock = socket.create_server((host, 0), backlog=4)
        self.address = f"{host}:{self._sock.getsockname()[1]}"

    def accept(self, token: str, timeout_s: float,
               stop: Callable[[], bool] | None = None) -> tuple[Stream, pb.TransferHello]:
        """The first connection that presents `token`; others are dropped after a short look
        (a stranger gets HELLO_TIMEOUT_S and a few bytes, no more). `stop` is asked between
        waits: the joiner may no longer need a donor."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if stop is not None and stop():
                raise TransferError("no longer waiting for a donor")
            self._sock.settimeout(min(left, POLL_S))
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            stream = Stream(conn)
            stream.settimeout(HELLO_TIMEOUT_S)
            try:
                kind, hello, _ = stream.receive(max_message=HELLO_MAX_BYTES, max_tensor_bytes=0)
            except (TransferError, OSError):
                stream.close()
                continue
            if kind is FrameKind.HELLO and isinstance(hello, pb.TransferHello) \
                    and hmac.compare_digest(hello.token.encode(), token.encode()):
                return stream, hello
            stream.close()  # a stranger or a stale donor: not ours
        raise TransferError(f"no donor connected within {timeout_s:.0f}s")

    def close(self) -> None:
        self._sock.close()


def connect(address: str, hello: pb.TransferHello, timeout_s: float) -> Stream:
    """The donor's side: connect to the joiner and introduce itself."""
    host, _, port = address.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except (OSError, ValueError) as exc:
        raise TransferError(f"cannot reach the joiner at {address}: {exc}") from None
    stream = Stream(sock)
    stream.send(FrameKind.HELLO, hello)
    return stream
