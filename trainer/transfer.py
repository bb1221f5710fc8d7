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

When the control plane runs TLS, so does the transfer (TLS 1.3): the joiner's listener
presents a certificate made for this worker with a fresh key, and the joiner reports its
SHA-256 with its address over its authenticated agent; the controller hands both to the
donor, which streams only to the peer presenting that certificate. The donor in turn is
authenticated by the one-time token. Not the job's CA: an agent's certificate is a client
certificate only (so that it cannot pose as a controller), and the controller's word is
what a donor needs to trust, which the pinned digest carries. A large state goes faster
outside TLS: its donor's hello then holds a fresh key, TLS ends there, and the bytes follow
as AES-GCM records sealed with that key on the same connection (`trainer/sealed.py`).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import socket
import ssl
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from enum import IntEnum
from typing import Any

import torch
from google.protobuf.message import DecodeError, Message

from recover.proto import pb
from recover.trainer.groups import gloo
from recover.trainer.sealed import SealedSocket, SealError, new_key
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

    def seal(self, key: bytes, donor: bool) -> None:
        """End TLS on this connection (both ends call this right after the hello) and
        carry the rest in records sealed with `key`."""
        if not isinstance(self._sock, ssl.SSLSocket):
            raise TransferError("only a TLS connection is sealed")
        try:
            raw = self._sock.unwrap()
            self._sock = SealedSocket(raw, key, donor)  # type: ignore[assignment]
        except (ssl.SSLError, OSError, SealError) as exc:
            raise TransferError(f"the peer ended the transfer's TLS badly: {exc}") from None

    def send(self, kind: FrameKind, message: Message, tensors: Sequence[torch.Tensor] = ()) -> None:
        payload = message.SerializeToString()
        cpu = [t.detach().to("cpu").contiguous() for t in tensors]
        total = sum(t.numel() * t.element_size() for t in cpu)
        try:
            self._sock.sendall(HEADER.pack(MAGIC, kind, len(payload), total) + payload)
            for t in cpu:
                self._sock.sendall(as_bytes(t))
        except (OSError, SealError) as exc:
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
            except (OSError, SealError) as exc:
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


def _transfer_certificate() -> tuple[ssl.SSLContext, str]:
    """A TLS 1.3 server context with a fresh key and a self-signed certificate, and the
    certificate's SHA-256 (hex): what a donor pins."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "recover transfer")])
    now = datetime.datetime.now(datetime.UTC)
    # Pinned, not verified against a CA: the validity only has to cover the worker's life.
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=3650)).sign(key, hashes.SHA256()))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    # No session tickets: the donor never reads, and unread bytes in its socket (tickets
    # sent after the handshake) make its close a reset, which discards the state's last
    # bytes on their way to the joiner.
    context.num_tickets = 0
    # ssl loads a key only from a file: one in a private folder, gone once loaded.
    with tempfile.TemporaryDirectory(prefix="recover-transfer-") as folder:
        cert_path, key_path = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
        with open(cert_path, "wb") as f:
            f.write(cert.public_bytes(serialization.Encoding.PEM))
        with open(os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM,
                                      serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
        context.load_cert_chain(cert_path, key_path)
    return context, hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def _warm(server: ssl.SSLContext, done: threading.Event) -> None:
    """A join's whole path once with itself over a socket pair, off any join's path: a
    handshake, TLS ended, and a sealed record each way. A process's first handshake costs
    3.1-3.5 ms on the client side against 0.9 ms for later ones (OpenSSL's first use;
    measured in BENCHMARKS.md section 8), and its first sealed record 0.8 ms against 0.02
    (the cipher's first fetch); a worker's first join is most often its only one, and a
    worker's first donation too. A failure here changes nothing but that first join's
    speed."""
    ours, theirs = socket.socketpair()
    gloo.exclude_sockets([ours, theirs])  # never a generation group's to sweep
    key = new_key()
    try:
        ours.settimeout(HELLO_TIMEOUT_S)
        theirs.settimeout(HELLO_TIMEOUT_S)
        accepting = threading.Thread(target=_shake_and_seal,
                                     args=(server.wrap_socket, theirs, True, key), daemon=True)
        accepting.start()
        _shake_and_seal(_client_context().wrap_socket, ours, False, key)
        accepting.join(HELLO_TIMEOUT_S)
    finally:
        gloo.include_sockets([ours, theirs])
        ours.close()
        theirs.close()
        done.set()


def _shake_and_seal(wrap: Callable[..., ssl.SSLSocket], sock: socket.socket,
                    server_side: bool, key: bytes) -> None:
    """One end of `_warm`; failures are ignored (it only warms)."""
    try:
        tls = wrap(sock, server_side=server_side)  # `sock`'s descriptor is now `tls`'s
    except (ssl.SSLError, OSError):
        return
    try:
        sealed = SealedSocket(tls.unwrap(), key, donor=not server_side)
        sealed.sendall(b"warm")
        sealed.recv_into(bytearray(4))
    except (ssl.SSLError, OSError, SealError):
        pass
    finally:
        tls.close()


class Listener:
    """The joiner's listening socket, open for its whole life (joins can be retried)."""

    def __init__(self, host: str, tls: bool = False) -> None:
        self._sock = socket.create_server((host, 0), backlog=4)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._tls: ssl.SSLContext | None = None
        self.tls_sha256 = ""
        """The certificate a donor must see (empty: plain TCP)."""
        self.warmed = threading.Event()
        """Set once `_warm` ran (TLS only): a handshake and sealed records done once here."""
        if tls:
            self._tls, self.tls_sha256 = _transfer_certificate()
            threading.Thread(target=_warm, args=(self._tls, self.warmed), daemon=True,
                             name="transfer-tls-warm").start()

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
            conn.settimeout(HELLO_TIMEOUT_S)  # the handshake too: a stranger gets no longer
            if self._tls is not None:
                try:
                    conn = self._tls.wrap_socket(conn, server_side=True)
                except (ssl.SSLError, OSError):
                    conn.close()
                    continue
            stream = Stream(conn)
            try:
                kind, hello, _ = stream.receive(max_message=HELLO_MAX_BYTES, max_tensor_bytes=0)
            except (TransferError, OSError):
                stream.close()
                continue
            if kind is FrameKind.HELLO and isinstance(hello, pb.TransferHello) \
                    and hmac.compare_digest(hello.token.encode(), token.encode()):
                if self._tls is None or not hello.stream_key:
                    return stream, hello
                try:
                    stream.seal(hello.stream_key, donor=False)
                    return stream, hello
                except TransferError:
                    pass  # a donor that did not follow the protocol: wait for another
            stream.close()  # a stranger or a stale donor: not ours
        raise TransferError(f"no donor connected within {timeout_s:.0f}s")

    def close(self) -> None:
        self._sock.close()


def connect(address: str, hello: pb.TransferHello, timeout_s: float,
            tls_sha256: str = "", seal: bool = False) -> Stream:
    """The donor's side: connect to the joiner (over TLS to the certificate `tls_sha256`
    when given) and introduce itself; with `seal`, the rest goes in sealed records instead
    of TLS's (for large states: it costs one more round trip first)."""
    host, _, port = address.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except (OSError, ValueError) as exc:
        raise TransferError(f"cannot reach the joiner at {address}: {exc}") from None
    if not tls_sha256:
        stream = Stream(sock)
        stream.send(FrameKind.HELLO, hello)
        return stream
    stream = Stream(_pinned(sock, address, tls_sha256))
    key = new_key() if seal else b""
    keyed = pb.TransferHello()
    keyed.CopyFrom(hello)
    keyed.stream_key = key
    try:
        stream.send(FrameKind.HELLO, keyed)
        if seal:
            stream.seal(key, donor=True)
    except TransferError:
        stream.close()
        raise
    return stream


@functools.cache
def _client_context() -> ssl.SSLContext:
    """One for the process: it holds settings only (no certificate, no session kept), and
    making one costs ~0.2 ms of a join's critical path."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # checked by _pinned, against the pinned digest
    return context


def _pinned(sock: socket.socket, address: str, sha256: str) -> ssl.SSLSocket:
    """`sock` over TLS 1.3 to a peer whose certificate has this SHA-256, or TransferError."""
    try:
        tls = _client_context().wrap_socket(sock)
    except (ssl.SSLError, OSError) as exc:
        sock.close()
        raise TransferError(f"no TLS with the joiner at {address}: {exc}") from None
    der = tls.getpeercert(binary_form=True) or b""
    if not hmac.compare_digest(hashlib.sha256(der).hexdigest(), sha256):
        tls.close()
        raise TransferError(f"the peer at {address} is not the joiner: its certificate is "
                            "not the one the joiner reported")
    return tls
