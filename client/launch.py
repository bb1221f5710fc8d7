"""Handing a job to a child `recover` process.

`recover run` hands its job to the controllers it starts, and the benchmarks hand theirs
to the `recover run` they start, as the serialized JobConfig (`hand_over`): the child takes
it as it is, so nothing of the job is lost or reparsed on the way. `job_to_args` spells a
JobConfig out as the flags a person would type to get it back (its round trip through the
flags is tested; every setting comes from recover.client.jobsettings).
"""

from __future__ import annotations

import os
from pathlib import Path

from recover.client.jobsettings import job_flags
from recover.proto import pb

JOB_PROTO_FLAG = "--job-proto"
"""The job flag (hidden from --help) that names a file written by `hand_over`."""


def hand_over(job: pb.JobConfig, path: Path) -> list[str]:
    """Write `job` to `path`; the flags that make a child `recover run` or `recover
    controller` take it (its other job flags are then ignored)."""
    # Owner-only, created anew: the job names the command every worker host runs, so no
    # other user may read it for secrets in the command or swap it for their own.
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(job.SerializeToString(deterministic=True))
    return [JOB_PROTO_FLAG, str(path)]


def taken_over(path: str) -> pb.JobConfig:
    """The job `hand_over` wrote (OSError, or protobuf's DecodeError for other bytes)."""
    return pb.JobConfig.FromString(Path(path).read_bytes())


def job_to_args(job: pb.JobConfig) -> list[str]:
    """The flags that rebuild `job`. They end with `-- COMMAND`: a caller's own flags go
    before them."""
    return [*job_flags(job), "--", *job.workload.command]
