"""A worker the agent did not start: the user's own process, attached.

`python train.py` run outside ReCoVer (the single-process mode, trainer/standalone.py)
starts `recover run --replicas 1 --attach PID` and becomes that job's one worker itself,
so that it keeps its terminal, its debugger and its stdin. Its agent cannot spawn, reap or
restart it: it learns of its exit from a pidfd (the moment it happens, as for a child),
and tells the process where to attach through a small file.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path

from recover.agent.warmstart import ReportedExit

EXIT_UNKNOWN = 1
"""The exit code reported for an attached process: not the agent's child, so its real status
cannot be read; what matters is that it is gone."""


@dataclass
class AttachedProcess(ReportedExit):
    """A process the agent did not start; a pidfd tells of its exit."""

    _pidfd: int = -1

    def watch(self) -> bool:
        """Start watching for its exit; False when it is gone already."""
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            self._gone()
            return False
        asyncio.get_running_loop().add_reader(self._pidfd, self._gone)
        return True

    def _gone(self) -> None:
        if self._pidfd >= 0:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1
        self.exited(EXIT_UNKNOWN)

    def kill(self) -> None:
        """Never: it is the user's own process (a debugger may hold it), and it ends when the
        job tells it to or when its user does. A job that must stop goes on without it."""


def write_attach_file(path: Path, *, replica: int, slot: int, agent_address: str,
                      transfer_host: str) -> None:
    """Where the attached process finds its identity (written whole, then renamed)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"replica": replica, "slot": slot, "agent_address": agent_address,
                               "transfer_host": transfer_host}))
    os.replace(tmp, path)
