"""`--resume DIR`: a job that lost every replica starts again from its newest authentic checkpoint.

The job is the operator's invocation, as for a fresh run: the worker command, the
checkpoint folder, the replicas, timeouts and security all come from this command line
(the original one, with `--resume DIR` added). A checkpoint is data: it gives the state,
the step and the ledger, and its copy of the job is only compared with the invocation,
so that a resumed run cannot silently be another job. Compared (a mismatch is a one-line
error): what decides the trajectory, namely the command and the settings in `CHECKED`.
Taken from the invocation without comparing: everything else (replicas, spares,
timeouts, policy, faults, emulated compute), since exact mode's trajectory does not
depend on them. Without `--checkpoint-dir` the resumed job goes on writing into the
folder it resumes from, on the checkpoint's schedule.

A newer file that is torn, damaged, or not authentic (planted, or edited by someone
without the folder's key) is passed over, and the user is told.
"""

from __future__ import annotations

import re
from pathlib import Path

from recover.cli.jobargs import UsageError
from recover.client.jobsettings import SETTINGS
from recover.common import ckptfile
from recover.proto import pb

CHECKED = ("steps", "global_microbatches", "seed", "reduce", "reduce_dtype",
           "workload.config_json")
"""JobConfig fields that decide the trajectory (the workload sees `steps`, e.g. for its LR
schedule): a resumed job has the checkpointed job's."""


def resumed_job(target: str, job: pb.JobConfig, *, job_id_given: bool = False,
                checkpoint_dir_given: bool = False) -> tuple[pb.JobConfig, list[str]]:
    """(the job to run, notes for the user): `job`, built from the invocation, set to resume
    from the newest authentic checkpoint of folder `target` (or from file `target`)."""
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
                         "there is nothing to resume (nor to extend with more --steps: a job's "
                         "step count is part of its trajectory, which the workload sees, e.g. "
                         "for its learning-rate schedule; a longer run is a new job)")
    early = next((f for f in job.testing.faults if f.step < meta.step), None)
    if early is not None:
        raise UsageError(f"--kill step={early.step},replica={early.replica},phase={early.phase}: "
                         f"the resumed job starts at step {meta.step} ({latest.path.name}), so "
                         "it would never fire")
    problem = difference(job, meta.job)
    if problem:
        raise UsageError(f"--resume {target!r}: {problem} in {latest.path.name}: a resumed job "
                         "is the job that was checkpointed (give its flags and command again)")
    resumed = pb.JobConfig()
    resumed.CopyFrom(job)
    resumed.resume.path = str(latest.path.resolve())
    resumed.resume.step = meta.step
    # A new run of the same job: its own id (a store may still hold the old one's state).
    base = job.job_id if job_id_given else meta.job.job_id
    resumed.job_id = f"{re.sub(r'-from-[0-9]+$', '', base)}-from-{meta.step}"
    if not checkpoint_dir_given:
        resumed.checkpoint.CopyFrom(meta.job.checkpoint)
        resumed.checkpoint.dir = str(latest.path.resolve().parent)
    notes = [f"passed over: {reason}" for reason in latest.skipped]
    notes.append(f"resuming job {meta.job.job_id} from {latest.path} (the state before step "
                 f"{meta.step} of {meta.job.steps}); the command and settings are this command "
                 "line's, checked against the checkpoint's")
    return resumed, notes


def difference(job: pb.JobConfig, checkpointed: pb.JobConfig) -> str | None:
    """The first trajectory setting in which `job` is not `checkpointed`, as "X here, Y";
    None when they agree."""
    for setting in SETTINGS:
        if setting.field in CHECKED:
            here, there = setting.flags(job), setting.flags(checkpointed)
            if here != there:
                return (f"{' '.join(here) or f'no {setting.flag}'} here, "
                        f"{' '.join(there) or f'no {setting.flag}'}")
    ours, theirs = list(job.workload.command), list(checkpointed.workload.command)
    if ours == theirs:
        return None
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
              min(len(ours), len(theirs)))
    if at <= 1 or (at == 2 and "-m" in (ours[1:2] + theirs[1:2])):
        # Another program altogether (the script or module differs): show both commands.
        return (f"the worker command is {_shown(ours)!r} here, {_shown(theirs)!r}")
    # A flag's value differs most often: show the flag with it.
    start = at - 1 if at > 0 and ours[at - 1].startswith("-") else at
    return (f"the worker command has {' '.join(ours[start:at + 1]) or 'nothing more'!r} "
            f"here, {' '.join(theirs[start:at + 1]) or 'nothing more'!r}")


def _shown(command: list[str], limit: int = 80) -> str:
    text = " ".join(command) or "(none)"
    return text if len(text) <= limit else text[:limit - 3] + "..."
