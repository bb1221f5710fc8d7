"""Training state as a typed tree plus raw tensor bytes (trainer/statewire.py), and the
transfer stream that carries it between two processes' sockets (trainer/transfer.py)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from recover.proto import pb
from recover.trainer.statewire import (
    StateEncodingError,
    as_bytes,
    decode,
    empty_tensors,
    encode,
)
from recover.trainer.transfer import FrameKind, Listener, Stream, TransferError, connect


def optimizer_state() -> dict:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    model(torch.ones(4, 3, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5)
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "lr_scheduler": scheduler.state_dict(),
            "extra": {"counter": {"n": 3, "name": "x", "blob": b"\x00\x01", "none": None,
                                  "flag": True, "big": 2**62, "f": 0.1}}}


def roundtrip(state: dict) -> dict:
    encoded = encode(state)
    manifest = pb.StateManifest.FromString(encoded.manifest().SerializeToString())
    tensors = list(empty_tensors(manifest.tensors))
    for received, sent in zip(tensors, encoded.tensors, strict=True):
        as_bytes(received)[:] = as_bytes(sent)  # what a transfer does, minus the socket
    return decode(manifest.root, tensors)


def assert_same(a: object, b: object) -> None:
    # An OrderedDict comes back a dict: load_state_dict takes either.
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape  # type: ignore[union-attr]
        assert torch.equal(a, b)  # type: ignore[arg-type]
    elif isinstance(a, dict):
        assert list(a) == list(b)  # type: ignore[arg-type]
        for key in a:
            assert_same(a[key], b[key])  # type: ignore[index]
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)  # type: ignore[arg-type]
        for x, y in zip(a, b, strict=True):  # type: ignore[call-overload]
            assert_same(x, y)
    else:
        assert a == b


def test_a_real_training_state_survives_the_wire() -> None:
    state = optimizer_state()
    assert_same(roundtrip(state), state)


def test_the_snapshot_is_a_copy_that_training_may_run_past() -> None:
    weight = torch.ones(3)
    encoded = encode({"w": weight})
    weight.add_(1)
    assert torch.equal(encoded.tensors[0], torch.ones(3))
    assert encoded.nbytes == 12


@pytest.mark.parametrize("state, where", [
    ({"fn": print}, "state['fn']: a builtin_function_or_method cannot be sent"),
    ({"x": {1: 2, "a": 3}}, "state['x']: dict keys must be all strings or all ints"),
    ({"x": [1, object()]}, r"state['x'][1]: a object cannot be sent"),
    ({"x": 2**70}, "does not fit in 64 bits"),
])
def test_what_cannot_travel_is_named_with_its_path(state: dict, where: str) -> None:
    with pytest.raises(StateEncodingError) as caught:
        encode(state)
    assert where in str(caught.value)


def streams() -> tuple[Stream, Stream]:
    a, b = socket.socketpair()
    return Stream(a), Stream(b)


def test_frames_carry_a_message_and_its_tensors() -> None:
    sender, receiver = streams()
    grads = [torch.arange(6, dtype=torch.float32).view(2, 3), torch.ones(4, dtype=torch.bfloat16)]
    step = pb.CatchUpStep(step=7, loss=1.5, tensors=[
        pb.TensorMeta(dtype="float32", shape=[2, 3], nbytes=24),
        pb.TensorMeta(dtype="bfloat16", shape=[4], nbytes=8)])
    threading.Thread(target=sender.send, args=(FrameKind.STEP, step, grads)).start()
    kind, message, tensors = receiver.receive()
    assert kind is FrameKind.STEP and message == step
    assert all(torch.equal(a, b) for a, b in zip(tensors, grads, strict=True))
    sender.close()
    with pytest.raises(TransferError, match="closed"):
        receiver.receive()
    receiver.close()


def test_garbage_and_lies_are_refused() -> None:
    a, b = socket.socketpair()
    receiver = Stream(b)
    a.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    with pytest.raises(TransferError, match="not a ReCoVer transfer frame"):
        receiver.receive()
    receiver.close()
    a.close()


def test_a_joiner_accepts_only_the_donor_with_its_token() -> None:
    listener = Listener("127.0.0.1")
    host, port = listener.address.rsplit(":", 1)
    stranger = socket.create_connection((host, int(port)))
    Stream(stranger).send(FrameKind.HELLO, pb.TransferHello(token="guess", donor=9, joiner=1))
    donor: list[Stream] = []
    threading.Thread(target=lambda: donor.append(connect(
        listener.address, pb.TransferHello(token="s3cret", donor=2, joiner=1), 5.0))).start()
    stream, hello = listener.accept("s3cret", 10.0)
    assert hello.donor == 2
    stream.close()
    with pytest.raises(TransferError, match="no donor connected"):
        listener.accept("s3cret", 0.3)
    listener.close()
    stranger.close()


class Tap:
    """A TCP relay that records what crosses it (what someone on the network would see)."""

    def __init__(self, target: str) -> None:
        self.seen = bytearray()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        client, _ = self._server.accept()
        upstream = socket.create_connection(self._target)
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                self.seen += data
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:  # either end went away: so does the relay
            pass


@pytest.mark.parametrize("seal", [False, True], ids=["tls-records", "sealed-records"])
def test_over_tls_a_donor_streams_encrypted_and_only_to_the_certificate_reported(seal: bool
                                                                                 ) -> None:
    """Issue 22: with a control plane on TLS, the joiner's listener presents a certificate
    made for it and the donor pins the digest the controller handed it. On the wire: neither
    the token nor the state's bytes in the clear, whether the bytes go in TLS's records or
    (a large state) in records sealed with the key the hello carried."""
    listener = Listener("127.0.0.1", tls=True)
    assert len(listener.tls_sha256) == 64
    # A plaintext stranger who even knows the token gets nowhere (no TLS handshake).
    stranger = socket.create_connection(tuple(listener.address.rsplit(":", 1)))  # type: ignore[arg-type]
    Stream(stranger).send(FrameKind.HELLO, pb.TransferHello(token="s3cret", donor=9, joiner=1))
    tap = Tap(listener.address)
    secret = torch.full((1024,), 7.25)
    sent: list[Stream] = []

    def donate() -> None:
        stream = connect(tap.address, pb.TransferHello(token="s3cret", donor=2, joiner=1), 5.0,
                         tls_sha256=listener.tls_sha256, seal=seal)
        stream.send(FrameKind.STEP, pb.CatchUpStep(step=3, tensors=[
            pb.TensorMeta(dtype="float32", shape=[1024], nbytes=4096)]), [secret])
        sent.append(stream)

    donor = threading.Thread(target=donate)
    donor.start()
    stream, hello = listener.accept("s3cret", 10.0)
    assert hello.donor == 2 and len(hello.stream_key) == (16 if seal else 0)
    kind, message, tensors = stream.receive()
    assert kind is FrameKind.STEP and message.step == 3 and torch.equal(tensors[0], secret)
    donor.join(10)
    assert b"s3cret" not in tap.seen and as_bytes(secret).tobytes()[:64] not in tap.seen
    assert len(tap.seen) > 4096  # the bytes did cross the tap, encrypted
    assert not seal or hello.stream_key not in tap.seen  # the key went inside TLS
    stream.close()
    sent[0].close()
    stranger.close()
    # A donor handed another digest refuses the peer before sending anything: the joiner
    # (accepting meanwhile) never hears its hello.
    refused: list[BaseException] = []
    gave_up = threading.Event()
    waiting = threading.Thread(target=lambda: refused.append(pytest.raises(
        TransferError, listener.accept, "s3cret", 60.0, gave_up.is_set).value))
    waiting.start()
    with pytest.raises(TransferError, match="its certificate is not the one the joiner reported"):
        connect(listener.address, pb.TransferHello(token="s3cret", donor=2, joiner=1), 30.0,
                tls_sha256="0" * 64)
    gave_up.set()
    waiting.join(30)
    assert "no longer waiting for a donor" in str(refused[0])
    listener.close()


@pytest.mark.parametrize("seal", [False, True], ids=["tls-records", "sealed-records"])
def test_over_tls_a_donor_that_closes_at_once_loses_none_of_its_bytes(seal: bool) -> None:
    """The donor closes right after its last frame; the joiner reads it all afterwards. (A
    TLS server's session tickets, unread in the donor's socket, would turn that close into
    a reset that discards the bytes still on their way.)"""
    listener = Listener("127.0.0.1", tls=True)
    state = torch.arange(2 << 20, dtype=torch.float32)  # 8 MB: more than the socket buffers
    accepted: list[Stream] = []
    joiner = threading.Thread(target=lambda: accepted.append(listener.accept("s3cret", 30.0)[0]))
    joiner.start()
    donor = connect(listener.address, pb.TransferHello(token="s3cret", donor=2, joiner=1), 30.0,
                    tls_sha256=listener.tls_sha256, seal=seal)
    joiner.join(30)
    sending = threading.Thread(target=lambda: (donor.send(FrameKind.STEP, pb.CatchUpStep(
        step=1, tensors=[pb.TensorMeta(dtype="float32", shape=[2 << 20], nbytes=8 << 20)]),
        [state]), donor.close()))
    sending.start()
    time.sleep(0.2)  # the donor has closed (or is closing) before the joiner reads
    _, _, tensors = accepted[0].receive()
    sending.join(30)
    assert torch.equal(tensors[0], state)
    accepted[0].close()
    listener.close()
