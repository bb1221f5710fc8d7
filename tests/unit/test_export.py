"""The model out: `recover.trainer.load_checkpoint` and `recover export`, on a checkpoint
written as the trainer writes one (a model with a tied weight and BatchNorm buffers, AdamW
state). The end-to-end check on a real job is tests/integration/test_batchnorm.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

import recover.trainer as rt
from recover.cli.main import main
from recover.common import ckptfile
from recover.proto import pb
from recover.trainer.statewire import as_bytes, encode


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.norm = nn.BatchNorm1d(3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight  # shares memory: safetensors needs copies


def trained() -> tuple[Tied, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tied()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.head(model.norm(model.embed(torch.tensor([0, 1, 2, 3])))).sum().backward()
    optimizer.step()
    return model, optimizer


def write_checkpoint(folder: Path, step: int, model: nn.Module,
                     optimizer: torch.optim.Optimizer, rank: int = 0, ranks: int = 1) -> Path:
    state = {"workload": {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                          "extra": {}}, "reduction": {}}
    encoded = encode(state)
    meta = pb.CheckpointMeta(job=pb.JobConfig(job_id="job-x", steps=9, ranks_per_replica=ranks),
                             step=step, state=encoded.manifest())
    return ckptfile.write(folder, meta, (as_bytes(t) for t in encoded.tensors), rank=rank)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_load_checkpoint_gives_plain_state_dicts(tmp_path: Path) -> None:
    model, optimizer = trained()
    write_checkpoint(tmp_path, 3, model, optimizer)
    newest = write_checkpoint(tmp_path, 6, model, optimizer)
    for where in (newest, tmp_path, str(tmp_path)):
        checkpoint = rt.load_checkpoint(where)
        assert (checkpoint.step, checkpoint.job_id, checkpoint.path) == (6, "job-x", newest)
        assert_same(checkpoint.model, model.state_dict())
    assert checkpoint.lr_scheduler is None and checkpoint.extra == {}
    fresh = Tied()
    fresh.load_state_dict(checkpoint.model)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    fresh_optimizer.load_state_dict(checkpoint.optimizer)
    assert torch.equal(fresh_optimizer.state_dict()["state"][0]["exp_avg"],
                       optimizer.state_dict()["state"][0]["exp_avg"])


def test_load_checkpoint_refuses_what_it_cannot_trust(tmp_path: Path) -> None:
    model, optimizer = trained()
    path = write_checkpoint(tmp_path, 3, model, optimizer)
    data = bytearray(path.read_bytes())
    data[-40] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(rt.CheckpointError, match="fails authentication"):
        rt.load_checkpoint(path)
    with pytest.raises(rt.CheckpointError, match="no authentic, intact checkpoint"):
        rt.load_checkpoint(tmp_path)
    with pytest.raises(rt.CheckpointError, match="no checkpoint file or folder"):
        rt.load_checkpoint(tmp_path / "missing.rcv")


def test_a_sharded_replicas_checkpoint_loads_as_a_set_and_is_pruned_as_one(
        tmp_path: Path) -> None:
    model, optimizer = trained()
    for step in (2, 4, 6):
        write_checkpoint(tmp_path, step, model, optimizer, rank=1, ranks=2)  # the others' first
        head = write_checkpoint(tmp_path, step, model, optimizer, rank=0, ranks=2)
    assert head.name == "ckpt-0000000006.rcv"
    assert ckptfile.rank_file(head, 1).name == "ckpt-0000000006.rank1.rcv"
    # Each rank holds the whole model here (no shards): the set loads as rank 0's.
    assert_same(rt.load_checkpoint(tmp_path).model, model.state_dict())
    ckptfile.prune(tmp_path, keep=2)  # the set of step 2 goes, its rank file with it
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == [
        "ckpt-0000000004.rank1.rcv", "ckpt-0000000004.rcv",
        "ckpt-0000000006.rank1.rcv", "ckpt-0000000006.rcv"]


def test_export_writes_files_plain_torch_and_safetensors_load(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, optimizer = trained()
    write_checkpoint(tmp_path / "ckpt", 6, model, optimizer)
    for name in ("m.pt", "m.safetensors"):
        assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / name)]) == 0
        assert "after 6 steps" in capsys.readouterr().out
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o600
    assert_same(torch.load(tmp_path / "m.pt", weights_only=True), model.state_dict())
    assert_same(safetensors.torch.load_file(tmp_path / "m.safetensors"), model.state_dict())
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "all.pt"),
                 "--with-optimizer"]) == 0
    everything = torch.load(tmp_path / "all.pt", weights_only=True)
    assert everything["step"] == 6 and sorted(everything) == [
        "extra", "lr_scheduler", "model", "optimizer", "step"]
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("args, code, message", [
    (["CKPT", "OUT/m.bin"], 2, "name the file OUT.pt, OUT.pth or OUT.safetensors"),
    (["CKPT", "OUT/none/m.pt"], 2, "no folder"),
    (["CKPT", "OUT/m.safetensors", "--with-optimizer"], 2, "--with-optimizer writes a .pt/.pth"),
    (["OUT/empty", "OUT/m.pt"], 1, "recover export: no checkpoint in"),
])
def test_export_mistakes_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      args: list[str], code: int, message: str) -> None:
    model, optimizer = trained()
    write_checkpoint(tmp_path / "ckpt", 6, model, optimizer)
    (tmp_path / "empty").mkdir()
    argv = [a.replace("CKPT", str(tmp_path / "ckpt")).replace("OUT", str(tmp_path))
            for a in args]
    assert main(["export", *argv]) == code
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
