"""What an agent reports of a worker's exit (agent/workers.py exit_report): the status as the
agent knows it, and nothing made up for a process it did not start (an attached one)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from recover.agent.attached import EXIT_UNKNOWN, AttachedProcess
from recover.agent.warmstart import ForkedProcess
from recover.agent.workers import WorkerProcess, exit_report
from recover.common import progress
from recover.proto import pb


def worker(tmp_path: Path, process: ForkedProcess | AttachedProcess, *, fault: str,
           stamped: bool) -> WorkerProcess:
    path = None
    if not isinstance(process, AttachedProcess):  # an attached process has no progress file
        path = tmp_path / "progress.bin"
        progress.create(path)
        if stamped:
            beacon = progress.ProgressBeacon(path)
            beacon.mark_killed()
            beacon.close()
    note = pb.FaultNote(step=2, phase=fault) if fault else None
    return WorkerProcess(replica=3, slot=0, process=process, fault=note, progress_path=path)


@pytest.mark.parametrize("attached, returncode, fault, stamped, code, sig, unknown", [
    # (attached?, what the agent learned, the fault it noted, kill stamped?) -> the report
    (False, -signal.SIGKILL, "backward", True, 0, 9, False),
    (False, 3, "", False, 3, 0, False),
    (True, EXIT_UNKNOWN, "backward", False, 0, 9, False),  # its own crash fault: a SIGKILL
    (True, EXIT_UNKNOWN, "stop", False, EXIT_UNKNOWN, 0, True),  # a hang ended some other way
    (True, EXIT_UNKNOWN, "", False, EXIT_UNKNOWN, 0, True),  # killed by someone else
], ids=["child-killed", "child-exit-code", "attached-killed-itself", "attached-hang",
        "attached-gone"])
def test_exit_report_says_what_the_agent_knows(tmp_path: Path, attached: bool, returncode: int,
                                               fault: str, stamped: bool, code: int, sig: int,
                                               unknown: bool) -> None:
    process = AttachedProcess(pid=1) if attached else ForkedProcess(pid=1)
    report = exit_report(worker(tmp_path, process, fault=fault, stamped=stamped), returncode)
    assert (report.exit_code, report.signal, report.status_unknown) == (code, sig, unknown)
    assert (report.fault.killed_at > 0) == stamped

