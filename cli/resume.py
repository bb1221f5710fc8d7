"""`--resume DIR`: the job a set of checkpoints describes, ready to start again.

A job that lost every replica (or its whole cluster) restarts from its newest
intact checkpoint: the same job (model command, M, seed, reduction, steps),
every worker loading the checkpoint's state before its first step, and the
controller starting from the checkpoint's step ledger. A newer checkpoint that
is torn or damaged is passed over, and the user is told.
"""

from __future__ import annotations

import re
from pathlib import Path

from recover.cli.jobargs import UsageError
from recover.common import ckptfile
from recover.proto import pb


def resumed_job(target: str) -> tuple[pb.JobConfig, pb.CheckpointMeta, list[str]]:
    """(the job to run, the checkpoint's meta, notes for the user) from a checkpoint folder
    (its newest intact checkpoint) or one checkpoint file."""
    path = Path(target)
    try:
        if path.is_file():
            meta, _ = ckptfile.read_meta(path)
            latest = ckptfile.Latest(path, meta)
        else:
            latest = ckptfile.latest(path)
    except ckptfile.CheckpointError as exc:
        raise UsageError(f"--resume {target!r}: {exc}") from None
    meta = latest.meta
    if meta.step >= meta.job.steps:
        raise UsageError(f"--resume {target!r}: {latest.path} holds the state after the last "
                         f"of job {meta.job.job_id}'s {meta.job.steps} steps: the job finished, "
                         "there is nothing to resume")
    job = pb.JobConfig()
    job.CopyFrom(meta.job)
    job.resume.path = str(latest.path.resolve())
    job.resume.step = meta.step
    # A new run of the same job: its own id (a store may still hold the old one's state),
    # and none of the interrupted run's injected faults.
    job.job_id = f"{re.sub(r'-from-[0-9]+$', '', meta.job.job_id)}-from-{meta.step}"
    job.testing.ClearField("faults")
    notes = [f"passed over: {reason}" for reason in latest.skipped]
    notes.append(f"resuming job {meta.job.job_id} from {latest.path} (the state before step "
                 f"{meta.step} of {job.steps}); the job's settings are the checkpoint's, job "
                 "options on this command line are not used")
    return job, meta, notes
