"""The step digest (trainer/digest.py): chunked so that threads can hash a large model, the
same bits whatever the threads, and told apart from the one-stream digest of older builds."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from recover.trainer import digest
from recover.trainer.digest import (
    CHUNK_BYTES,
    legacy_step_digest,
    legacy_tensor_digest,
    step_digest,
    tensor_digest,
)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(digest, "CHUNK_BYTES", 64)  # many chunks from small tensors
    return 64


def tensors() -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    return [("w", torch.randn(7, 9)), ("empty", torch.zeros(0)), ("b", torch.randn(40)),
            ("half", torch.randn(33).to(torch.bfloat16)), ("steps", torch.tensor(5))]


def test_the_digest_is_the_same_on_any_number_of_threads(small_chunks: int) -> None:
    alone = tensor_digest(tensors())
    for threads in (1, 2, 5):
        with ThreadPoolExecutor(threads) as pool:
            assert tensor_digest(tensors(), pool) == alone
    assert step_digest(tensors(), tensors()[:1], ThreadPoolExecutor(3)) == \
        f"{alone}+{tensor_digest(tensors()[:1])}"


def test_the_digest_is_per_chunk_sha256_as_documented(small_chunks: int) -> None:
    # Written out by hand from digest.DIGEST_SCHEME's docstring.
    t = torch.arange(40, dtype=torch.float32)  # 160 bytes: chunks of 64, 64 and 32
    raw = t.numpy().tobytes()
    h = hashlib.sha256(b"x|torch.float32|(40,)|160|")
    for at in range(0, 160, small_chunks):
        h.update(hashlib.sha256(raw[at:at + small_chunks]).digest())
    assert tensor_digest([("x", t)]) == h.hexdigest()
    # A tensor of one chunk has its one sha256; an empty one its header alone.
    one = torch.arange(4, dtype=torch.int64)
    h = hashlib.sha256(b"y|torch.int64|(4,)|32|" + hashlib.sha256(one.numpy().tobytes()).digest())
    h.update(b"e|torch.float32|(0,)|0|")
    assert tensor_digest([("y", one), ("e", torch.zeros(0))]) == h.hexdigest()


@pytest.mark.parametrize("change", ["value", "name", "dtype", "shape", "chunk-order"])
def test_any_change_changes_the_digest(small_chunks: int, change: str) -> None:
    named = tensors()
    name, t = named[2]
    last_bit = t.clone()
    last_bit[-1] = torch.nextafter(t[-1], torch.tensor(float("inf")))  # in the last chunk
    named[2] = {"value": (name, last_bit),
                "name": ("c", t), "dtype": (name, t.to(torch.float64)),
                "shape": (name, t.reshape(8, 5)),
                "chunk-order": (name, torch.cat([t[16:32], t[:16], t[32:]]))}[change]
    assert tensor_digest(named) != tensor_digest(tensors())


def test_older_builds_digest_is_kept_for_their_checkpoints() -> None:
    named = tensors()
    h = hashlib.sha256()
    for name, t in named:
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    assert legacy_tensor_digest(named) == h.hexdigest() != tensor_digest(named)
    assert legacy_step_digest(named, named[:1]) == f"{h.hexdigest()}+{legacy_tensor_digest(named[:1])}"
    assert CHUNK_BYTES == 16 << 20  # a new size is a new scheme: DIGEST_SCHEME names it
    assert digest.DIGEST_SCHEME == "sha256/16MiB"


def test_bytes_viewed_through_numpy_digest_as_through_torch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The numpy view is only a cheaper way to the same bytes: DIGEST_SCHEME is unchanged.
    named = [("w", torch.randn(3, 4)), ("count", torch.tensor(5)),
             ("strided", torch.randn(4, 3).t()), ("bf16", torch.randn(5).bfloat16()),
             ("mask", torch.tensor([True, False])), ("p", torch.nn.Parameter(torch.randn(7))),
             ("f64", torch.randn(2, dtype=torch.float64)), ("f16", torch.randn(3).half()),
             ("every_other", torch.arange(6, dtype=torch.int32)[::2])]
    viewed = digest.tensor_digest(named)
    monkeypatch.setattr(digest, "_NUMPY_VIEWS", ())
    assert digest.tensor_digest(named) == viewed
