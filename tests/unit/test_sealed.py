"""Sealed records (trainer/sealed.py): what a join's bytes travel in after the TLS hello.

In-process, over socket pairs: every way a record can be altered on the wire fails its
check, and reads of any size give back exactly the bytes sent.
"""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from recover.trainer.sealed import RECORD_BYTES, TAG_BYTES, SealedSocket, SealError, new_key


def _pair(key: bytes | None = None) -> tuple[SealedSocket, SealedSocket, socket.socket, socket.socket]:
    a, b = socket.socketpair()
    for s in (a, b):
        s.settimeout(10)
    key = key or new_key()
    return SealedSocket(a, key, donor=True), SealedSocket(b, key, donor=False), a, b


def _read(sealed: SealedSocket, n: int, step: int | None = None) -> bytes:
    out = bytearray(n)
    view, done = memoryview(out), 0
    while done < n:
        got = sealed.recv_into(view[done:done + step] if step else view[done:])
        assert got > 0
        done += got
    return bytes(out)


def _capture(payload: bytes) -> list[bytes]:
    """The records a donor writes for `payload`, one wire chunk each."""
    donor, _, a, b = _pair(key=b"k" * 16)
    sender = threading.Thread(target=donor.sendall, args=(payload,))
    sender.start()
    wire = bytearray()
    expected = sum(4 + min(RECORD_BYTES, len(payload) - i) + TAG_BYTES
                   for i in range(0, len(payload), RECORD_BYTES))
    while len(wire) < expected:
        wire += b.recv(1 << 20)
    sender.join(10)
    a.close()
    b.close()
    records, at = [], 0
    while at < len(wire):
        n = int.from_bytes(wire[at:at + 4], "big")
        records.append(bytes(wire[at:at + 4 + n + TAG_BYTES]))
        at += 4 + n + TAG_BYTES
    return records


def _joiner_reading(wire: bytes, key: bytes = b"k" * 16) -> SealedSocket:
    a, b = socket.socketpair()
    b.settimeout(10)

    def write() -> None:  # from a thread: more than a socket buffer holds
        try:
            a.sendall(wire)
        except OSError:  # the reader gave up first
            pass
        a.close()

    threading.Thread(target=write, daemon=True).start()
    return SealedSocket(b, key, donor=False)


@pytest.mark.parametrize("size,read_step", [
    (0, None), (1, None), (21, 7), (RECORD_BYTES, None), (RECORD_BYTES + 1, None),
    (3 * RECORD_BYTES + 5, 4096), (2 * RECORD_BYTES, 3 * RECORD_BYTES // 2),
])
def test_any_split_of_reads_gives_back_the_bytes_sent(size: int, read_step: int | None) -> None:
    """Reads smaller than a record are served from the decrypted record, larger ones take
    whole records straight into the caller's memory: the same bytes either way."""
    donor, joiner, a, b = _pair()
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    sender = threading.Thread(target=lambda: (donor.sendall(payload), donor.sendall(b"end")))
    sender.start()
    assert _read(joiner, size, read_step) == payload
    assert _read(joiner, 3) == b"end"
    sender.join(10)
    a.close()
    b.close()


def test_a_record_larger_than_the_ones_before_it_is_served_by_small_reads_too() -> None:
    """The buffer for a record read in pieces starts at the record's size (a frame's header
    and message: small) and grows when a larger record is read in pieces later."""
    donor, joiner, a, b = _pair()
    small, large = b"h" * 21, bytes(range(256)) * (RECORD_BYTES // 256)
    sender = threading.Thread(target=lambda: (donor.sendall(small), donor.sendall(large)))
    sender.start()
    assert _read(joiner, len(small), 7) == small
    assert _read(joiner, len(large), 4096) == large
    sender.join(10)
    a.close()
    b.close()


@pytest.mark.parametrize("change,match", [
    ("flip a ciphertext byte", "failed its check"),
    ("flip a tag byte", "failed its check"),
    ("change the length", "failed its check"),
    ("swap two records", "failed its check"),
    ("repeat a record", "failed its check"),
    ("drop the first record", "failed its check"),
    ("cut a record short", "closed the connection inside a sealed record"),
    ("announce an oversized record", "a sealed record of"),
    ("announce an empty record", "a sealed record of 0 bytes"),
])
def test_a_record_altered_on_the_wire_is_refused(change: str, match: str) -> None:
    records = _capture(bytes(2 * RECORD_BYTES + 100))
    first = bytearray(records[0])
    if change == "flip a ciphertext byte":
        first[4 + 10] ^= 1
        wire = bytes(first) + b"".join(records[1:])
    elif change == "flip a tag byte":
        first[-1] ^= 0x80
        wire = bytes(first) + b"".join(records[1:])
    elif change == "change the length":
        first[:4] = (RECORD_BYTES - 1).to_bytes(4, "big")  # the tag covers the length
        wire = bytes(first) + b"".join(records[1:])
    elif change == "swap two records":
        wire = records[1] + records[0] + records[2]
    elif change == "repeat a record":
        wire = records[0] + records[0] + records[1]
    elif change == "drop the first record":
        wire = b"".join(records[1:])
    elif change == "cut a record short":
        wire = records[0][:1000]
    elif change == "announce an oversized record":
        wire = (RECORD_BYTES + 1).to_bytes(4, "big") + bytes(64)
    else:
        wire = bytes(4 + TAG_BYTES)
    joiner = _joiner_reading(wire)
    with pytest.raises(SealError, match=match):
        _read(joiner, 2 * RECORD_BYTES + 100)


def test_a_record_is_bound_to_its_direction_and_its_key() -> None:
    """The joiner's own record sent back to it, or the donor's read under another key,
    fails its check."""
    _, joiner, a, b = _pair(key=b"k" * 16)
    joiner.sendall(b"x" * 100)
    echoed = a.recv(4096)  # the joiner's record, as it left
    a.close()
    b.close()
    with pytest.raises(SealError, match="failed its check"):
        _read(_joiner_reading(echoed), 100)
    with pytest.raises(SealError, match="failed its check"):
        _read(_joiner_reading(_capture(b"y" * 100)[0], key=new_key()), 100)


def test_a_key_of_the_wrong_size_is_refused() -> None:
    with pytest.raises(SealError, match="16 bytes, not 5"):
        SealedSocket(socket.socket(), b"short", donor=True)


def test_the_peer_closing_between_records_reads_as_the_end() -> None:
    joiner = _joiner_reading(b"")
    assert joiner.recv_into(bytearray(10)) == 0


@pytest.mark.parametrize("kilobytes,sealed", [(512, False), (2048, True)])
def test_a_donor_seals_a_large_state_and_keeps_tls_records_for_a_small_one(
        kilobytes: int, sealed: bool) -> None:
    """Donation decides by the snapshot's size (joining.SEAL_FROM_BYTES = 1 MiB): the
    joiner sees the key in the hello only for the large one, and gets the state either way."""
    from recover.proto import pb
    from recover.trainer.joining import SEAL_FROM_BYTES, Donation
    from recover.trainer.statewire import encode
    from recover.trainer.transfer import FrameKind, Listener

    assert (kilobytes << 10 >= SEAL_FROM_BYTES) is sealed
    state = {"w": torch.arange(kilobytes << 8, dtype=torch.float32)}  # 4 bytes each
    listener = Listener("127.0.0.1", tls=True)
    donation = Donation(pb.Donate(donor=0, joiner=1, address=listener.address, token="t",
                                  tls_sha256=listener.tls_sha256), 0, encode(state), 0)
    donation.finish_before(0)  # no step to catch up: the snapshot, then the end
    stream, hello = listener.accept("t", 30.0)
    assert len(hello.stream_key) == (16 if sealed else 0)
    kinds, received = [], None
    while not kinds or kinds[-1] is not FrameKind.END:
        kind, _, tensors = stream.receive()
        kinds.append(kind)
        received = tensors if kind is FrameKind.SNAPSHOT else received
    assert kinds == [FrameKind.PREVIEW, FrameKind.SNAPSHOT, FrameKind.END]
    assert received is not None and torch.equal(received[0], state["w"])
    assert donation.done.wait(30) and not donation.failed
    stream.close()
    listener.close()


def test_a_tls_listener_warms_both_sides_of_a_handshake_once_and_still_serves_a_donor() -> None:
    """`Listener(tls=True)` shakes hands with itself over a socket pair on a thread (OpenSSL's
    first use, off the first join's path); the warming ends by itself, leaves no thread, and
    the pinned connection of a real donor works as before."""
    import threading

    from recover.proto import pb
    from recover.trainer.transfer import FrameKind, Listener, connect

    listener = Listener("127.0.0.1", tls=True)
    assert listener.warmed.wait(30)
    for thread in threading.enumerate():
        if thread.name == "transfer-tls-warm":
            thread.join(30)
            assert not thread.is_alive()

    def donate() -> None:
        donor = connect(listener.address, pb.TransferHello(token="t", donor=0, joiner=1), 30,
                        tls_sha256=listener.tls_sha256, seal=True)
        donor.send(FrameKind.END, pb.TransferEnd(reason="done"))
        donor.close()

    donating = threading.Thread(target=donate, daemon=True)
    donating.start()
    stream, hello = listener.accept("t", 30.0)
    assert hello.donor == 0 and len(hello.stream_key) == 16
    kind, message, _ = stream.receive()
    assert kind is FrameKind.END and message.reason == "done"
    donating.join(30)
    stream.close()
    listener.close()
    assert not Listener("127.0.0.1").warmed.is_set()  # plain TCP: nothing to warm
