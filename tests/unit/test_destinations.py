"""Where a joiner receives a snapshot (trainer/destinations.py): its own built tensors where
they fit, memory prepared from the donor's preview elsewhere, fresh memory for surprises."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from recover.proto import pb
from recover.trainer.destinations import Destinations, own_tensors, tensor_paths
from recover.trainer.joining import Catchup
from recover.trainer.statewire import as_bytes, decode, encode
from recover.trainer.transfer import HEADER, MAGIC, FrameKind, Listener, Stream, TransferError


def model_and_optimizer(seed: int, stepped: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if stepped:  # Adam's state exists only after a step
        model(torch.randn(3, 8)).sum().backward()
        optimizer.step()
    return model, optimizer


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "extra": [{"n": 3}, (torch.arange(5),)], "by_id": {7: torch.ones(2)}}


def test_paths_name_every_tensor_as_encode_walks_the_tree() -> None:
    state = {"a": [torch.zeros(1), {"b": torch.ones(2)}], "c": {3: torch.ones(1)}, "d": 1}
    encoded = encode(state)
    assert tensor_paths(encoded.root) == ["state['a'][0]", "state['a'][1]['b']", "state['c'][3]"]


def test_the_built_model_receives_in_place_and_the_rest_is_prepared() -> None:
    donor_state = state_of(*model_and_optimizer(0, stepped=True))
    joiner_model, joiner_optimizer = model_and_optimizer(1, stepped=False)
    own = own_tensors(state_of(joiner_model, joiner_optimizer))
    preview = encode(donor_state, check_only=True).manifest()
    destinations = Destinations(preview, own)
    snapshot = encode(donor_state)
    manifest = snapshot.manifest()
    targets = list(destinations.for_snapshot(manifest))

    weight = joiner_model[0].weight
    by_path = dict(zip(tensor_paths(manifest.root), targets, strict=True))
    assert by_path["state['model']['0.weight']"].data_ptr() == weight.data_ptr()
    assert own.used
    model_bytes = sum(p.numel() * 4 for p in joiner_model.parameters())
    assert destinations.reused_bytes >= model_bytes
    assert destinations.reused_bytes + destinations.prepared_bytes == snapshot.nbytes

    for target, sent in zip(targets, snapshot.tensors, strict=True):
        target.copy_(sent)  # what the stream does with the bytes
    joiner_model.load_state_dict(decode(manifest.root, targets)["model"])
    assert torch.equal(joiner_model[0].weight, donor_state["model"]["0.weight"])


def test_a_snapshot_unlike_its_preview_still_lands_in_memory_of_its_own_shape() -> None:
    preview = encode({"w": torch.zeros(4), "gone": torch.zeros(2)}, check_only=True).manifest()
    destinations = Destinations(preview, None)
    snapshot = encode({"w": torch.zeros(5, dtype=torch.float64), "new": torch.ones(3)})
    targets = list(destinations.for_snapshot(snapshot.manifest()))
    assert [(t.dtype, t.shape) for t in targets] == [(torch.float64, (5,)), (torch.float32, (3,))]


def test_tied_or_device_or_strided_tensors_are_never_written_in_place() -> None:
    shared = torch.zeros(4, 4)
    state = {"a": shared, "tied": shared, "strided": torch.zeros(4, 4).t(), "empty": torch.zeros(0)}
    assert list(own_tensors(state).by_path) == ["state['a']"]


def test_a_preview_then_a_snapshot_over_a_stream() -> None:
    a, b = socket.socketpair()
    donor, joiner = Stream(a), Stream(b)
    donor_state = state_of(*model_and_optimizer(0, stepped=True))
    joiner_model, joiner_optimizer = model_and_optimizer(1, stepped=False)
    own = own_tensors(state_of(joiner_model, joiner_optimizer))

    def send() -> None:
        donor.send(FrameKind.PREVIEW, encode(donor_state, check_only=True).manifest())
        snapshot = encode(donor_state)
        donor.send(FrameKind.SNAPSHOT, snapshot.manifest(), snapshot.tensors)

    sender = threading.Thread(target=send)
    sender.start()
    kind, preview, tensors = joiner.receive()
    assert kind is FrameKind.PREVIEW and not tensors  # a layout, no bytes
    destinations = Destinations(preview, own)  # type: ignore[arg-type]
    kind, manifest, tensors = joiner.receive(into=destinations.for_snapshot)
    assert kind is FrameKind.SNAPSHOT
    state = decode(manifest.root, tensors)  # type: ignore[attr-defined]
    joiner_model.load_state_dict(state["model"])
    joiner_optimizer.load_state_dict(state["optimizer"])
    for mine, theirs in zip(joiner_model.state_dict().values(), donor_state["model"].values(),
                            strict=True):
        assert torch.equal(mine, theirs)
    assert torch.equal(state["optimizer"]["state"][0]["exp_avg"],
                       donor_state["optimizer"]["state"][0]["exp_avg"])
    sender.join()
    donor.close()
    joiner.close()


def test_destinations_that_do_not_fit_the_frame_are_refused() -> None:
    a, b = socket.socketpair()
    donor, joiner = Stream(a), Stream(b)
    snapshot = encode({"w": torch.ones(4)})
    sender = threading.Thread(target=donor.send, args=(FrameKind.SNAPSHOT, snapshot.manifest(),
                                                       snapshot.tensors))
    sender.start()
    with pytest.raises(TransferError, match="no room"):
        joiner.receive(into=lambda manifest: [torch.empty(2)])
    sender.join()
    donor.close()
    joiner.close()


def test_a_donor_lost_mid_snapshot_spoils_the_built_state_and_a_retry_restores_it() -> None:
    donor_state = state_of(*model_and_optimizer(0, stepped=True))
    joiner_model, joiner_optimizer = model_and_optimizer(1, stepped=False)
    own = own_tensors(state_of(joiner_model, joiner_optimizer))
    listener = Listener("127.0.0.1")

    def donate(cut: bool) -> None:
        host, port = listener.address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        stream = Stream(sock)
        stream.send(FrameKind.HELLO, pb.TransferHello(token="t", donor=0, joiner=1))
        stream.send(FrameKind.PREVIEW, encode(donor_state, check_only=True).manifest())
        snapshot = encode(donor_state)
        if cut:  # the whole header, half the bytes, then the donor is gone
            payload = snapshot.manifest().SerializeToString()
            sock.sendall(HEADER.pack(MAGIC, FrameKind.SNAPSHOT, len(payload), snapshot.nbytes)
                         + payload + bytes(as_bytes(snapshot.tensors[0])))
        else:
            stream.send(FrameKind.SNAPSHOT, snapshot.manifest(), snapshot.tensors)
            stream.send(FrameKind.END, pb.TransferEnd())
        stream.close()

    command = pb.Join(joiner=1, donor=0, token="t", attempt=1)
    built = joiner_model[0].weight.detach().clone()
    for cut in (True, False):
        donor = threading.Thread(target=donate, args=(cut,))
        donor.start()
        if cut:
            with pytest.raises(TransferError, match="closed"):
                Catchup(listener, command, own=own)
            assert own.used  # the caller must not enter with the built state any more
            assert not torch.equal(joiner_model[0].weight, built)  # bytes landed in place
        else:
            catchup = Catchup(listener, command, own=own)
            assert catchup.destinations is not None and catchup.destinations.reused_bytes > 0
            joiner_model.load_state_dict(catchup.state["model"])
            assert catchup.next() is None
            catchup.close()
        donor.join()
    for mine, theirs in zip(joiner_model.state_dict().values(), donor_state["model"].values(),
                            strict=True):
        assert torch.equal(mine, theirs)
    listener.close()
