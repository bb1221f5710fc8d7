"""Checkpoint files (common/ckptfile.py), the schedule and loading (trainer/checkpoint.py),
and the restart policy of agents (agent/restarts.py). Authentication (the folder's key,
forged and edited files, what a resume takes from a file): test_checkpoint_auth.py."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from recover.agent.restarts import decide_restart, recent_restarts
from recover.common import ckptfile
from recover.proto import pb
from recover.trainer.checkpoint import CheckpointWriter, checkpoint_due, load
from recover.trainer.statewire import as_bytes, encode


def write(folder: Path, step: int, value: float = 1.0) -> Path:
    encoded = encode({"w": torch.full((4,), value), "step": step})
    meta = pb.CheckpointMeta(job=pb.JobConfig(job_id="j", steps=50), step=step,
                             state=encoded.manifest(), ledger=[pb.StepRecord(step=0)])
    return ckptfile.write(folder, meta, (as_bytes(t) for t in encoded.tensors))


def flip(data: bytes, index: int) -> bytes:
    """One byte changed: what bit rot does."""
    position = index % len(data)
    return data[:position] + bytes([data[position] ^ 0xFF]) + data[position + 1:]


def test_a_written_checkpoint_reads_back(tmp_path: Path) -> None:
    path = write(tmp_path, 20, 3.5)
    assert path.name == "ckpt-0000000020.rcv"
    meta, state = load(str(path))
    assert meta.step == 20 and meta.job.job_id == "j" and len(meta.ledger) == 1
    assert torch.equal(state["w"], torch.full((4,), 3.5)) and state["step"] == 20
    assert not list(tmp_path.glob(".*tmp"))  # no temporary file left


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "is truncated"),
    (lambda p: p.write_bytes(flip(p.read_bytes(), -40)), "fails authentication"),
    (lambda p: p.write_bytes(b"garbage" * 10), "not a ReCoVer checkpoint"),
])
def test_the_newest_intact_checkpoint_is_used_saying_why(tmp_path: Path, damage, message) -> None:
    write(tmp_path, 10)
    newest = write(tmp_path, 20)
    damage(newest)
    latest = ckptfile.latest(tmp_path)
    assert latest.meta.step == 10
    assert len(latest.skipped) == 1 and message in latest.skipped[0]
    with pytest.raises(ckptfile.CheckpointError, match=message):
        ckptfile.read_meta(newest)


def test_no_checkpoint_is_an_error_naming_the_folder(tmp_path: Path) -> None:
    with pytest.raises(ckptfile.CheckpointError, match="no checkpoint in .*nothing-here"):
        ckptfile.latest(tmp_path / "nothing-here")
    newest = write(tmp_path, 10)
    newest.write_bytes(newest.read_bytes()[:100])
    with pytest.raises(ckptfile.CheckpointError, match="no authentic, intact checkpoint in .*"
                                                       r"\(ckpt-0000000010.rcv is truncated"):
        ckptfile.latest(tmp_path)


def test_pruning_keeps_the_newest(tmp_path: Path) -> None:
    for step in (5, 10, 15, 20):
        write(tmp_path, step)
    removed = ckptfile.prune(tmp_path, keep=2)
    assert [p.name for p in removed] == ["ckpt-0000000010.rcv", "ckpt-0000000005.rcv"]
    assert [s for s, _ in ckptfile.listed(tmp_path)] == [20, 15]


@pytest.mark.parametrize("next_step, every_steps, every_s, last_step, age, due", [
    (10, 5, 0.0, -1, 0.0, True),
    (11, 5, 0.0, 10, 0.0, False),
    (10, 5, 0.0, 10, 0.0, False),   # written already (or being written)
    (0, 5, 0.0, -1, 0.0, False),    # the initial state: nothing to save
    (7, 0, 30.0, 3, 31.0, True),
    (7, 0, 30.0, 3, 29.0, False),
])
def test_checkpoint_due(next_step, every_steps, every_s, last_step, age, due) -> None:
    assert checkpoint_due(next_step, every_steps=every_steps, every_s=every_s,
                          last_step=last_step, last_at=100.0, now=100.0 + age) is due


def test_the_writer_copies_at_the_boundary_and_writes_in_the_background(tmp_path: Path) -> None:
    reports: list[pb.CheckpointWritten] = []
    weight = torch.ones(1000)
    writer = CheckpointWriter(pb.CheckpointConfig(dir=str(tmp_path), every_steps=2, keep=2),
                              pb.JobConfig(job_id="j"), 0, reports.append, first_step=0)
    writer.maybe_write(1, lambda: {"w": weight}, [])  # not due
    writer.maybe_write(2, lambda: {"w": weight}, [])
    weight.add_(1)  # training goes on: the checkpoint holds the copy taken at the boundary
    writer.close()
    assert [r.step for r in reports] == [2] and reports[0].bytes > 4000
    assert torch.equal(load(reports[0].path)[1]["w"], torch.ones(1000))


@pytest.mark.parametrize("restarts, maximum, over, contract, restart, delay, reason", [
    (0, 3, False, False, True, 0.5, "slot 1: restart 1 of 3 in 0.5s"),
    (2, 3, False, False, True, 2.0, "restart 3 of 3 in 2.0s"),
    (3, 3, False, False, False, 0.0, "restarted 3 times in the last 1800s already"),
    (0, 0, False, False, False, 0.0, "--max-restarts 0"),
    (0, 3, True, False, False, 0.0, "the job is over"),
    (0, 3, False, True, False, 0.0, "broke the workload's contract"),
    (10, 99, False, False, True, 30.0, "in 30.0s"),
])
def test_decide_restart(restarts, maximum, over, contract, restart, delay, reason) -> None:
    decision = decide_restart(1, restarts, maximum, job_over=over, deterministic_error=contract)
    assert (decision.restart, decision.delay_s) == (restart, delay)
    assert reason in decision.reason


def test_a_slow_writer_makes_the_next_checkpoint_skip(tmp_path: Path, monkeypatch) -> None:
    release = []
    original = ckptfile.write

    def slow_write(folder, meta, chunks, **options):  # a checkpoint still on its way to disk
        while not release:
            time.sleep(0.01)
        return original(folder, meta, chunks, **options)

    monkeypatch.setattr(ckptfile, "write", slow_write)
    reports: list[pb.CheckpointWritten] = []
    writer = CheckpointWriter(pb.CheckpointConfig(dir=str(tmp_path), every_steps=1),
                              pb.JobConfig(), 0, reports.append, first_step=0)
    writer.maybe_write(1, lambda: {"w": torch.ones(2)}, [])
    writer.maybe_write(2, lambda: {"w": torch.ones(2)}, [])
    release.append(True)
    writer.close()
    assert [r.step for r in reports] == [1]


def test_a_failed_write_leaves_no_temporary_file_and_is_reported(tmp_path: Path) -> None:
    def chunks():
        yield b"x" * 100
        raise OSError(28, "No space left on device")

    meta = pb.CheckpointMeta(job=pb.JobConfig(job_id="j", steps=50), step=3)
    with pytest.raises(OSError, match="No space"):
        ckptfile.write(tmp_path, meta, chunks())
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.key"]  # no torn copy left

    reports: list[pb.CheckpointWritten] = []
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the folder should be")
    writer = CheckpointWriter(pb.CheckpointConfig(dir=str(blocked), every_steps=1),
                              pb.JobConfig(job_id="j", steps=50), 0, reports.append, 0)
    writer.maybe_write(1, lambda: {"w": torch.ones(2)}, [])
    writer.close()
    assert len(reports) == 1 and reports[0].step == 1 and reports[0].error


def test_resuming_a_finished_job_is_refused_with_a_reason(tmp_path: Path) -> None:
    from recover.cli.jobargs import UsageError
    from recover.cli.resume import resumed_job

    write(tmp_path, 50)
    with pytest.raises(UsageError, match="the job finished, there is nothing to resume"):
        resumed_job(str(tmp_path), pb.JobConfig(job_id="j", steps=50))
    with pytest.raises(UsageError, match=r"nothing to resume \(nor to extend with more --steps"):
        resumed_job(str(tmp_path), pb.JobConfig(job_id="j", steps=80))
    write(tmp_path / "part", 20)
    job, notes = resumed_job(str(tmp_path / "part"), pb.JobConfig(job_id="new", steps=50))
    assert job.resume.step == 20 and job.job_id == "j-from-20" and "checked" in notes[-1]


@pytest.mark.parametrize("times, now, window, counted", [
    ([], 100.0, 60.0, 0),
    ([10.0, 50.0, 90.0], 100.0, 60.0, 2),   # the one at 10 s is more than a window ago
    ([10.0, 50.0, 90.0], 200.0, 60.0, 0),   # healthy for a whole window: a fresh start
    ([99.5], 100.0, 1.0, 1),
    ([99.0], 100.0, 1.0, 0),                # exactly a window ago: no longer counts
])
def test_only_recent_restarts_count(times, now, window, counted) -> None:
    assert recent_restarts(times, now, window) == counted


@pytest.mark.parametrize(("existing", "resumed", "refused"), [
    pytest.param((), False, "", id="an-empty-folder"),
    pytest.param((4, 8), False, "holds 2 checkpoints already (newest ckpt-0000000008.rcv, step 8)",
                 id="a-new-job-into-another-jobs-folder"),
    pytest.param((8,), True, "", id="a-resumed-job-goes-on-in-its-folder"),
])
def test_a_new_job_is_refused_a_folder_with_checkpoints(tmp_path: Path, existing, resumed,
                                                          refused) -> None:
    from recover.cli.jobargs import UsageError
    from recover.cli.preflight import check_checkpoint_folder

    folder = tmp_path / "ck"
    folder.mkdir()
    for step in existing:
        write(folder, step)
    before = sorted(p.name for p in folder.iterdir())
    if refused:
        with pytest.raises(UsageError, match=f"{re.escape(refused)}.*--resume {folder}") as caught:
            check_checkpoint_folder(str(folder), resumed=resumed)
        assert "\n" not in str(caught.value)
        assert sorted(p.name for p in folder.iterdir()) == before  # nothing touched
    else:
        check_checkpoint_folder(str(folder), resumed=resumed)
        assert (folder / "checkpoint.key").exists()
