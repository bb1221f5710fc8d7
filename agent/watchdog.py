"""The hang watchdog: a worker that stopped making progress is killed, and its exit is then
recovered as a plain crash. It reads each worker's progress file (common/progress.py) and
judges it there; waiting for peers or the controller is never judged."""

from __future__ import annotations

import asyncio
import logging
import time

from recover.agent.workers import WorkerProcess, every_process
from recover.common import progress
from recover.proto import pb

log = logging.getLogger("recover.agent")
CONFIRM_HANG_S = 0.02
"""Pause before re-reading a hung-looking worker's progress file to confirm the verdict."""


async def watch_for_hangs(workers: dict[int, WorkerProcess], job: pb.JobConfig) -> None:
    """Kill workers that stopped making progress; their exit is then a plain crash."""
    timeout_s = job.hang_timeout_s or 2.0
    factor = job.hang_factor or 10.0
    first_grace_s = job.first_microbatch_grace_s or progress.FIRST_MICROBATCH_GRACE_S
    while True:
        await asyncio.sleep(progress.BEAT_PERIOD_S)
        for worker in every_process(workers):
            if worker.process.returncode is not None or worker.killed_by_agent:
                continue
            verdict = await hang_verdict(worker, timeout_s, factor, first_grace_s)
            if verdict is not None and verdict.hung:
                worker.killed_by_agent = f"watchdog: {verdict.reason}"
                log.warning("killing hung worker: %s", verdict.reason,
                            extra={"replica": worker.replica})
                worker.kill()


async def hang_verdict(worker: WorkerProcess, timeout_s: float, factor: float,
                       first_grace_s: float) -> progress.HangVerdict | None:
    """The watchdog's verdict on one worker, a hung one confirmed on a second read:
    a kill cannot be undone, a misread file can."""
    for attempt in range(2):
        if attempt:
            await asyncio.sleep(CONFIRM_HANG_S)
        snapshot = progress.read(worker.progress_path) if worker.progress_path else None
        if snapshot is None or worker.process.returncode is not None:
            return None
        verdict = progress.judge(snapshot, time.monotonic(), timeout_s, factor, first_grace_s)
        if not verdict.hung:
            return verdict
    return verdict
