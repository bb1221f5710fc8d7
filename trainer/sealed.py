"""A join's bulk bytes sealed with AES-GCM records over plain TCP, keyed inside TLS.

Python's `ssl` hands a reader one 16 KB TLS record per call, so a TLS stream of a
few hundred MB costs tens of thousands of calls on the joiner and ran at less than
half the speed of plain TCP on loopback (BENCHMARKS.md, issue 22). So TLS does what
only it can do here, the handshake (the joiner proves the certificate the donor
pinned) and carrying a fresh key in the donor's hello; both sides then shut TLS down
(close_notify both ways, nothing read past it) and the same TCP connection carries
records sealed with that key:

    record = length (4 bytes, big-endian, authenticated) | ciphertext | GCM tag (16 bytes)

A record's nonce is the sender's direction and its record count, so a record dropped,
repeated, reordered or moved to the other direction fails its tag; a key is used for
one connection only. A record holds at most `RECORD_BYTES`; a reader decrypts a
record that fits the bytes it asked for straight into them (a tensor's memory),
otherwise into a buffer it serves the next reads from. Bytes are handed to the
caller before the tag is checked, as TLS would not: a failed tag ends the transfer
with TransferError, and a joiner never uses a transfer that ended so (the next join
sends a whole new snapshot).
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

KEY_BYTES = 16
"""AES-128: TLS 1.3's mandatory suite's cipher; fresh per connection."""
RECORD_BYTES = 1 << 20
"""Largest record: large enough that a record's fixed cost (~7 us) is noise, small enough
that the donor encrypts the next record while the joiner decrypts this one."""
TAG_BYTES = 16
_LENGTH = struct.Struct(">I")
_DONOR_TO_JOINER, _JOINER_TO_DONOR = b"d2j\0", b"j2d\0"


class SealError(Exception):
    """A record failed its check or the peer went away; the message says which."""


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


class SealedSocket:
    """The socket surface `transfer.Stream` uses (sendall, recv_into, ...) over sealed
    records. `donor`: which end this is (the nonces of the two directions differ)."""

    def __init__(self, sock: socket.socket, key: bytes, donor: bool) -> None:
        if len(key) != KEY_BYTES:
            raise SealError(f"a stream key is {KEY_BYTES} bytes, not {len(key)}")
        # Imported here, not with the module: it costs every worker ~55 ms of start (a
        # restart's critical path), and most never seal anything.
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        self._sock = sock
        self._aes = algorithms.AES(key)
        self._cipher, self._gcm = Cipher, modes.GCM
        self._send_label, self._receive_label = ((_DONOR_TO_JOINER, _JOINER_TO_DONOR) if donor
                                                 else (_JOINER_TO_DONOR, _DONOR_TO_JOINER))
        self._sent = self._received = 0
        # Grown as records need (a join of a small model never fills a megabyte).
        self._out = bytearray()
        self._scratch = bytearray()
        self._pending_store = bytearray()
        self._pending = memoryview(b"")
        """Decrypted bytes of the last record not yet read (it was larger than asked)."""

    # -- what Stream needs of a socket
    @property
    def family(self) -> int:
        return self._sock.family

    def fileno(self) -> int:
        return self._sock.fileno()

    def setsockopt(self, *args: int) -> None:
        self._sock.setsockopt(*args)

    def settimeout(self, seconds: float | None) -> None:
        self._sock.settimeout(seconds)

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        self._sock.close()

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        need = _LENGTH.size + min(len(view), RECORD_BYTES) + TAG_BYTES
        if len(self._out) < need:  # doubling: tensors of growing sizes reallocate rarely
            self._out = bytearray(min(max(need, 2 * len(self._out)),
                                      _LENGTH.size + RECORD_BYTES + TAG_BYTES))
        out = memoryview(self._out)
        for start in range(0, len(view), RECORD_BYTES):
            chunk = view[start:start + RECORD_BYTES]
            n = len(chunk)
            _LENGTH.pack_into(out, 0, n)
            encryptor = self._gcm_cipher(self._nonce(self._send_label, self._sent)).encryptor()
            encryptor.authenticate_additional_data(out[:_LENGTH.size])
            encryptor.update_into(chunk, out[_LENGTH.size:_LENGTH.size + n])
            encryptor.finalize()
            out[_LENGTH.size + n:_LENGTH.size + n + TAG_BYTES] = encryptor.tag
            self._sent += 1
            self._sock.sendall(out[:_LENGTH.size + n + TAG_BYTES])

    def recv_into(self, view: memoryview | bytearray) -> int:
        """Fill the start of `view` with the next bytes; how many (0: the peer closed)."""
        view = memoryview(view).cast("B")
        if not len(view):
            return 0
        if not len(self._pending):
            header = bytearray(_LENGTH.size)
            if not self._read_exactly(memoryview(header), allow_end=True):
                return 0
            (n,) = _LENGTH.unpack(header)
            if not 0 < n <= RECORD_BYTES:
                raise SealError(f"a sealed record of {n} bytes (at most {RECORD_BYTES})")
            if n <= len(view):  # the usual case: a record lands in a tensor's memory
                self._open(bytes(header), n, view[:n])
                return n
            if len(self._pending_store) < n:  # a record past a small read: a frame's header
                # and message, most often kilobytes; a megabyte of fresh memory per
                # connection cost a demo-size join ~0.2 ms (page faults)
                self._pending_store = bytearray(min(max(n, 2 * len(self._pending_store)),
                                                    RECORD_BYTES))
            self._pending = memoryview(self._pending_store)[:n]
            self._open(bytes(header), n, self._pending)
        got = min(len(view), len(self._pending))
        view[:got] = self._pending[:got]
        self._pending = self._pending[got:]
        return got

    def _open(self, header: bytes, n: int, target: memoryview) -> None:
        if len(self._scratch) < n + TAG_BYTES:
            self._scratch = bytearray(min(max(n + TAG_BYTES, 2 * len(self._scratch)),
                                          RECORD_BYTES + TAG_BYTES))
        scratch = memoryview(self._scratch)[:n + TAG_BYTES]
        self._read_exactly(scratch)
        decryptor = self._gcm_cipher(self._nonce(self._receive_label, self._received),
                                     bytes(scratch[n:])).decryptor()
        decryptor.authenticate_additional_data(header)
        decryptor.update_into(scratch[:n], target)
        try:
            decryptor.finalize()
        except Exception:  # cryptography's InvalidTag
            raise SealError("a sealed record failed its check (altered, reordered or "
                            "not from the peer that holds the key)") from None
        self._received += 1

    def _read_exactly(self, view: memoryview, allow_end: bool = False) -> bool:
        done = 0
        while done < len(view):
            got = self._sock.recv_into(view[done:])
            if got == 0:
                if allow_end and done == 0:
                    return False
                raise SealError("the peer closed the connection inside a sealed record")
            done += got
        return True

    def _gcm_cipher(self, nonce: bytes, tag: bytes | None = None) -> Any:
        return self._cipher(self._aes, self._gcm(nonce, tag))

    @staticmethod
    def _nonce(label: bytes, count: int) -> bytes:
        return label + count.to_bytes(8, "big")
