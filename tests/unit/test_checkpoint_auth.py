"""Checkpoints are authenticated data (issue 22, point 1): the folder's key (common/ckptkey.py),
files refused when planted, edited (digests recomputed) or written with another key, and
a resume that takes the job from its invocation, never from a file."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from recover.cli.jobargs import UsageError
from recover.cli.resume import resumed_job
from recover.common import ckptfile, ckptkey
from recover.common.ckptfile import CheckpointError
from recover.proto import pb
from recover.trainer.checkpoint import load, load_checkpoint
from recover.trainer.digest import legacy_step_digest, parameter_digest
from recover.trainer.errors import WorkloadError
from recover.trainer.executorbase import ExecutorBase
from recover.trainer.statewire import as_bytes, encode
from tests.ckptforge import forge, payload_job

COMMAND = ["python", "train.py", "--hidden", "8"]


def job(**changes: object) -> pb.JobConfig:
    fields: dict = dict(job_id="j", steps=50, global_microbatches=8, seed=3, reduce="exact",
                        workload=pb.WorkloadSpec(command=COMMAND),
                        checkpoint=pb.CheckpointConfig(every_steps=10, keep=3))
    return pb.JobConfig(**{**fields, **changes})


def write(folder: Path, step: int, *, key: bytes | None = None, state: dict | None = None,
          digest: str = "") -> Path:
    encoded = encode(state if state is not None else {"w": torch.full((4,), float(step))})
    ledger = [pb.StepRecord(step=step - 1, loss=1.5,
                            param_sha256=[pb.ReplicaDigest(replica=0, param_sha256=digest)]
                            if digest else [])]
    meta = pb.CheckpointMeta(job=job(), step=step, state=encoded.manifest(), ledger=ledger)
    return ckptfile.write(folder, meta, (as_bytes(t) for t in encoded.tensors), key=key)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_files_folder_and_key_are_owner_only(tmp_path: Path) -> None:
    folder = tmp_path / "new" / "ckpt"
    path = write(folder, 10)
    key = ckptkey.key_path(folder)
    assert (mode(path), mode(folder), mode(key)) == (0o600, 0o700, 0o600)
    assert len(key.read_bytes()) == ckptkey.KEY_BYTES
    assert ckptkey.ensure(folder) == key.read_bytes()  # made once, never replaced


def test_a_planted_link_at_the_temporary_name_is_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("the user's own file")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / f".{ckptfile.file_name(5)}.{os.getpid()}.tmp").symlink_to(victim)
    write(tmp_path / "ckpt", 5)
    assert victim.read_text() == "the user's own file"
    assert load(str(tmp_path / "ckpt" / ckptfile.file_name(5)))[0].step == 5


def flip_first_tensor_byte(path: Path) -> None:
    meta, offset = ckptfile.read_meta(path)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_changed_tensor_byte_fails_the_full_read_not_the_meta(tmp_path: Path) -> None:
    """The meta alone (what the controller reads) has a MAC of its own."""
    path = write(tmp_path, 10)
    flip_first_tensor_byte(path)
    assert ckptfile.read_meta(path, verify=False)[0].step == 10
    for read in (lambda: ckptfile.read_meta(path), lambda: load(str(path))):
        with pytest.raises(ckptfile.CheckpointError, match="fails authentication"):
            read()


def edit_command(meta: pb.CheckpointMeta) -> None:
    payload_job(meta, Path("/tmp/never"), Path("/tmp/elsewhere"))


@pytest.mark.parametrize("forgery, message", [
    (lambda p, t: forge(p, t, edit_command), "fails authentication"),
    (lambda p, t: forge(p, t, lambda m: None, tensors=lambda b: b"\x00" + b[1:]),
     "fails authentication"),
    (lambda p, t: forge(p, t, edit_command, attacker_key=os.urandom(32)),
     "not written with this folder's key"),
    (lambda p, t: write(t.parent / "other", 30, key=os.urandom(32)).rename(t),
     "not written with this folder's key"),
    (lambda p, t: t.write_bytes(ckptfile.UNAUTHENTICATED_MAGIC + p.read_bytes()[8:]),
     "written without authentication"),
], ids=["meta-edited-sha-recomputed", "tensor-edited-sha-recomputed", "attacker-key",
        "another-jobs-key", "old-format"])
def test_a_forged_file_is_refused_with_one_line_naming_it(tmp_path: Path, forgery,
                                                            message: str) -> None:
    authentic = write(tmp_path, 10)
    target = tmp_path / ckptfile.file_name(30)
    forgery(authentic, target)
    for read in (lambda: ckptfile.read_meta(target, verify=False),
                 lambda: ckptfile.read_meta(target), lambda: load(str(target))):
        with pytest.raises(ckptfile.CheckpointError, match=message) as refused:
            read()
        assert target.name in str(refused.value) and "\n" not in str(refused.value)


def test_a_missing_or_unsafe_key_refuses_every_file(tmp_path: Path) -> None:
    path = write(tmp_path, 10)
    key = ckptkey.key_path(tmp_path)
    key.chmod(0o644)
    with pytest.raises(ckptfile.CheckpointError, match=r"open to other users \(mode 0644\)"):
        ckptfile.read_meta(path)
    key.chmod(0o600)
    secret = key.read_bytes()
    key.unlink()
    with pytest.raises(ckptfile.CheckpointError, match="no checkpoint key .*checkpoint.key"):
        ckptfile.latest(tmp_path)
    key.symlink_to(tmp_path / "elsewhere")  # a link in the key's place is never followed
    (tmp_path / "elsewhere").write_bytes(secret)
    (tmp_path / "elsewhere").chmod(0o600)
    with pytest.raises(ckptfile.CheckpointError, match="key .*checkpoint.key is a symbolic link"):
        ckptfile.read_meta(path)
    key.unlink()
    key.mkdir()  # a folder in the key's place: one line, not Python's IsADirectoryError
    with pytest.raises(ckptfile.CheckpointError, match="key .*checkpoint.key is not a regular file"):
        ckptfile.read_meta(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_key_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, 10)
    os.chown(ckptkey.key_path(tmp_path), 12345, 12345)
    with pytest.raises(ckptfile.CheckpointError, match="belongs to uid 12345"):
        ckptfile.read_meta(path)


def test_resume_passes_over_a_forged_newest_file_and_takes_the_job_from_the_invocation(
        tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    authentic = write(folder, 20)
    forge(authentic, folder / ckptfile.file_name(30),
          lambda m: (edit_command(m), setattr(m, "step", 30)))
    invocation = job(job_id="job-random", replicas=2)
    resumed, notes = resumed_job(str(folder), invocation)
    assert notes[0] == (f"passed over: {ckptfile.file_name(30)} fails authentication with the "
                        "folder's key (edited, forged or damaged): refused")
    assert resumed.resume.path == str(authentic.resolve()) and resumed.resume.step == 20
    assert list(resumed.workload.command) == COMMAND and resumed.replicas == 2
    assert resumed.checkpoint.dir == str(folder.resolve()) and resumed.job_id == "j-from-20"
    mine = job(checkpoint=pb.CheckpointConfig(dir=str(tmp_path / "new"), every_steps=5))
    resumed, _ = resumed_job(str(folder), mine, checkpoint_dir_given=True)
    assert resumed.checkpoint.dir == str(tmp_path / "new")


def test_a_kill_before_the_resumed_step_is_one_line(tmp_path: Path) -> None:
    write(tmp_path, 20)
    kill = pb.FaultSpec(step=5, replica=1, phase="forward")
    with pytest.raises(UsageError, match="--kill step=5,replica=1,phase=forward: the resumed job "
                                         "starts at step 20 .* it would never fire"):
        resumed_job(str(tmp_path), job(testing=pb.TestingConfig(faults=[kill])))
    kill.step = 20
    resumed_job(str(tmp_path), job(testing=pb.TestingConfig(faults=[kill])))  # it fires


@pytest.mark.parametrize("changes, message", [
    ({"seed": 4}, "--seed=4 here, --seed=3 in ckpt-0000000020.rcv"),
    ({"steps": 60}, "--steps=60 here, --steps=50"),
    ({"global_microbatches": 16}, "--global-microbatches=16 here"),
    ({"workload": pb.WorkloadSpec(command=["python", "train.py", "--hidden", "9"])},
     "the worker command has '--hidden 9' here, '--hidden 8'"),
    ({"workload": pb.WorkloadSpec(command=["sh", "-c", "touch x"])},
     "the worker command is 'sh -c touch x' here, 'python train.py --hidden 8'"),
    ({"workload": pb.WorkloadSpec(command=["python", "other.py", "--hidden", "8"])},
     "the worker command is 'python other.py --hidden 8' here, 'python train.py --hidden 8'"),
])
def test_a_resume_that_is_another_job_is_one_line(tmp_path: Path, changes, message) -> None:
    write(tmp_path, 20)
    with pytest.raises(UsageError, match=message) as refused:
        resumed_job(str(tmp_path), job(**changes))
    assert "\n" not in str(refused.value)


class Resuming:
    """What ExecutorBase.load_checkpoint needs of a replica: a model to load into, and its
    step digest (a model without buffers: its parameter digest). One process per replica:
    no lockstep, so it reads the set's head file."""

    lockstep = None

    def __init__(self, model: nn.Module) -> None:
        self.workload = SimpleNamespace(model=model, digest=lambda legacy=False: (
            legacy_step_digest(model.named_parameters()) if legacy else parameter_digest(model)))

    def load_training_state(self, state: dict, step: int, ledger: list) -> None:
        self.workload.model.load_state_dict(state["model"])

    def _ctx(self) -> dict[str, int]:
        return {}


def test_loaded_parameters_are_compared_with_the_ledger(tmp_path: Path) -> None:
    trained = nn.Linear(3, 2)
    state = {"model": {k: v.clone() for k, v in trained.state_dict().items()}}
    good = write(tmp_path / "good", 20, state=state, digest=parameter_digest(trained))
    ExecutorBase.load_checkpoint(Resuming(nn.Linear(3, 2)),  # type: ignore[arg-type]
                                 pb.ResumePoint(path=str(good), step=20))
    bad = write(tmp_path / "bad", 20, state=state, digest="0" * 64)
    with pytest.raises(WorkloadError, match="not the ones the ledger committed after step 19"):
        ExecutorBase.load_checkpoint(Resuming(nn.Linear(3, 2)),  # type: ignore[arg-type]
                                     pb.ResumePoint(path=str(bad), step=20))
    with pytest.raises(WorkloadError, match="holds the state before step 20, the job resumes"):
        ExecutorBase.load_checkpoint(Resuming(nn.Linear(3, 2)),  # type: ignore[arg-type]
                                     pb.ResumePoint(path=str(good), step=10))


def test_a_checkpoint_of_a_build_before_the_chunked_digest_still_resumes(tmp_path: Path) -> None:
    # Its ledger holds the one-stream sha256 of the parameters (digest.legacy_step_digest).
    trained = nn.Linear(3, 2)
    state = {"model": {k: v.clone() for k, v in trained.state_dict().items()}}
    legacy = legacy_step_digest(trained.named_parameters())
    assert legacy != parameter_digest(trained)
    old = write(tmp_path / "old", 20, state=state, digest=legacy)
    ExecutorBase.load_checkpoint(Resuming(nn.Linear(3, 2)),  # type: ignore[arg-type]
                                 pb.ResumePoint(path=str(old), step=20))


def test_planted_newer_files_do_not_make_pruning_delete_the_real_ones(tmp_path: Path) -> None:
    for step in (10, 20):
        authentic = write(tmp_path, step)
    for step in (900, 901, 902):  # as many as are kept: counted by name, nothing real would stay
        forge(authentic, tmp_path / ckptfile.file_name(step), lambda m: None)
    write(tmp_path, 30)
    removed = ckptfile.prune(tmp_path, keep=2)
    assert [p.name for p in removed] == [ckptfile.file_name(10)]
    assert ckptfile.latest(tmp_path).meta.step == 30


def test_the_controller_authenticates_the_resume_point_and_says_so_in_one_line(
        tmp_path: Path) -> None:
    from recover.controller.server import _resume_point
    good = write(tmp_path, 20)
    assert _resume_point(job(resume=pb.ResumePoint(path=str(good), step=20))).step == 20
    assert _resume_point(job()) is None
    with pytest.raises(OSError, match=r"holds step 20, the job resumes at step 10$"):
        _resume_point(job(resume=pb.ResumePoint(path=str(good), step=10)))
    forged = forge(good, tmp_path / ckptfile.file_name(30),
                   lambda meta: payload_job(meta, tmp_path / "pwned", tmp_path / "theirs"))
    with pytest.raises(OSError) as refused:
        _resume_point(job(resume=pb.ResumePoint(path=str(forged), step=30)))
    assert str(refused.value).startswith(f"cannot resume from {forged}: ")
    assert "\n" not in str(refused.value)


# ---------------------------------------------------------------- sets of a sharded replica

WHOLE = torch.arange(10.0).reshape(5, 2)
"""A parameter FSDP2 cut in two along dim 0 (uneven: 3 rows and 2, as torch.chunk does)."""


def write_rank(folder: Path, step: int, rank: int, weight: torch.Tensor, *,
               extra_key: str = "", layout: pb.TensorShard | None = None) -> Path:
    model = {"w": weight, "b": torch.ones(2), **({extra_key: torch.zeros(1)} if extra_key else {})}
    encoded = encode({"workload": {"model": model, "optimizer": {"step": 3},
                                   "extra": {}}})
    encoded.shards[0] = layout if layout is not None else \
        pb.TensorShard(global_shape=list(WHOLE.shape), dim=0)
    meta = pb.CheckpointMeta(job=job(ranks_per_replica=2), step=step, state=encoded.manifest())
    return ckptfile.write(folder, meta, (as_bytes(t) for t in encoded.tensors), rank=rank)


def test_a_sharded_set_loads_as_one_model_its_shards_put_back_in_place(tmp_path: Path) -> None:
    write_rank(tmp_path, 4, 1, WHOLE[3:])  # rank 1 first, the head last, as workers do
    head = write_rank(tmp_path, 4, 0, WHOLE[:3])
    loaded = load_checkpoint(tmp_path)
    assert loaded.path == head and loaded.step == 4
    assert torch.equal(loaded.model["w"], WHOLE) and torch.equal(loaded.model["b"], torch.ones(2))
    assert loaded.optimizer == {"step": 3}


@pytest.mark.parametrize("case", ["rank-file-named", "rank-file-missing", "pipeline-stages",
                                  "unmergeable-layout", "parts-do-not-fit"])
def test_what_cannot_be_one_model_is_one_line(tmp_path: Path, case: str) -> None:
    if case == "pipeline-stages":  # another stage: another state tree
        write_rank(tmp_path, 4, 1, WHOLE[3:], extra_key="stage1.only")
    elif case == "unmergeable-layout":
        write_rank(tmp_path, 4, 1, WHOLE[3:], layout=pb.TensorShard(global_shape=[5, 2], dim=-1))
    elif case == "parts-do-not-fit":
        write_rank(tmp_path, 4, 1, WHOLE[4:])
    elif case != "rank-file-missing":
        write_rank(tmp_path, 4, 1, WHOLE[3:])
    layout = pb.TensorShard(global_shape=[5, 2], dim=-1) if case == "unmergeable-layout" else None
    head = write_rank(tmp_path, 4, 0, WHOLE[:3], layout=layout)
    target = ckptfile.rank_file(head, 1) if case == "rank-file-named" else head
    want = {"rank-file-named": "is one rank's part of a checkpoint set: name the set's head",
            "rank-file-missing": "rank 1's file ckpt-0000000004.rank1.rcv is missing",
            "pipeline-stages": "there is no one model to merge",
            "unmergeable-layout": "cannot be put back together",
            "parts-do-not-fit": "parts make [4, 2], not the [5, 2]"}[case]
    with pytest.raises(CheckpointError, match=re.escape(want)):
        load_checkpoint(target)
