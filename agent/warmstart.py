"""Workers forked from a warm interpreter instead of started cold (the agent's side of
recover.agent.zygote): a restarted worker skips interpreter start and `import torch`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("recover.agent")


@dataclass(frozen=True)
class WarmDecision:
    """Whether a worker command can be forked from the warm interpreter, and why."""

    target: list[str] | None
    """What follows the interpreter (["-m", MODULE, *ARGS] or [SCRIPT, *ARGS]); None: cold."""
    reason: str


def decide_warm_start(command: list[str], executable: str, enabled: bool = True) -> WarmDecision:
    """Only `INTERPRETER SCRIPT ...` and `INTERPRETER -m MODULE ...` under the agent's own
    interpreter can be forked from it: a wrapper script, another Python or interpreter
    options (-u, -X ...) need the process they ask for."""
    if not enabled:
        return WarmDecision(None, "workers start cold (--cold-start)")
    if not command:
        return WarmDecision(None, "no worker command")
    interpreter, rest = command[0], command[1:]
    if os.path.realpath(interpreter) != os.path.realpath(executable):
        return WarmDecision(None, f"workers start cold: {interpreter} is not the agent's "
                                  f"interpreter ({executable})")
    if rest[:1] == ["-m"] and len(rest) >= 2 and not rest[1].startswith("-"):
        return WarmDecision(rest, f"workers fork from a warm interpreter (module {rest[1]})")
    if rest and not rest[0].startswith("-"):
        return WarmDecision(rest, f"workers fork from a warm interpreter (script {rest[0]})")
    if rest:
        return WarmDecision(None, f"workers start cold: interpreter option {rest[0]} needs a "
                                  "fresh interpreter")
    return WarmDecision(None, "workers start cold: the command names no script or module")


@dataclass
class ReportedExit:
    """The part of asyncio's Process the agent uses, for a process that is not the agent's
    child: someone else learns its exit and calls `exited`."""

    pid: int
    returncode: int | None = None
    _exited: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def exited(self, returncode: int) -> None:
        if self.returncode is None:
            self.returncode = returncode
            self._exited.set()


@dataclass
class ForkedProcess(ReportedExit):
    """A worker forked by the zygote, which reaps it the moment it exits and reports its
    status."""

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)


class WarmStarter:
    """One zygote per agent; `spawn` returns None whenever a worker must start cold."""

    def __init__(self, env: dict[str, str], log_path: Path | None,
                 preload: tuple[str, ...] | None = None) -> None:
        self.target: list[str] | None = None
        """What the workers run (decide_warm_start's target): set before the first spawn,
        which the zygote's imports need not wait for."""
        self._preload = preload
        """Modules the zygote imports before forking; None: its own list (torch, ...)."""
        self._env = env
        self._log_path = log_path
        self.broken = ""
        """Why workers start cold from now on (the zygote refused, failed or exited)."""
        self._ready: asyncio.Future[str] | None = None
        self._pending: dict[int, asyncio.Future[ForkedProcess | None]] = {}
        self._processes: dict[int, ForkedProcess] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._zygote: asyncio.subprocess.Process | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._next = 0
        self._closing = False

    @classmethod
    def for_agent(cls, env: dict[str, str], log_dir: str | None, agent_id: str) -> WarmStarter:
        """The agent's warm interpreter, logging beside its workers (if they log)."""
        log_path = Path(log_dir) / f"warm-{agent_id}.log" if log_dir else None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
        return cls(env, log_path)

    async def start(self, inherit: tuple[int, ...] = ()) -> None:
        """Start the zygote; it imports in the background while the agent goes on. Its
        workers inherit the descriptors in `inherit` (with their numbers)."""
        ours, theirs = socket.socketpair()
        try:
            # Its own session: a Ctrl-C meant for the agent must not kill every worker at once.
            self._zygote = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "recover.agent.zygote", "--control-fd", str(theirs.fileno()),
                "--agent-pid", str(os.getpid()),
                *(["--log", str(self._log_path)] if self._log_path is not None else []),
                *(["--preload", ",".join(self._preload)] if self._preload is not None else []),
                pass_fds=(theirs.fileno(), *inherit), env=self._env, stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True)
        except OSError as exc:
            ours.close()
            self.broken = f"cannot start the warm interpreter: {exc.strerror}"
            return
        finally:
            theirs.close()
        self._ready = asyncio.get_running_loop().create_future()
        reader, self._writer = await asyncio.open_unix_connection(sock=ours)
        self._reader_task = asyncio.create_task(self._read(reader))

    async def spawn(self, env: dict[str, str], cwd: str, log_path: Path | None
                    ) -> ForkedProcess | None:
        if self._ready is None or self._writer is None or self.broken or self.target is None:
            return None
        refused = await asyncio.shield(self._ready)
        if refused:
            self._give_up(refused)
            return None
        self._next += 1
        waiting = asyncio.get_running_loop().create_future()
        self._pending[self._next] = waiting
        request = {"spawn": self._next, "target": self.target, "env": env, "cwd": cwd,
                   "log": str(log_path) if log_path else None}
        try:
            self._writer.write(json.dumps(request).encode() + b"\n")
            await self._writer.drain()
        except (ConnectionError, RuntimeError) as exc:
            self._pending.pop(self._next, None)
            self._give_up(f"the warm interpreter is gone ({exc})")
            return None
        return await waiting

    def forget(self, fd: int) -> None:
        """The zygote closes its copy of a descriptor it inherited (`start`): the job turned
        out not to need it, and no worker it forks from now on holds it."""
        if self._writer is not None and not self.broken:
            with contextlib.suppress(ConnectionError, RuntimeError):
                self._writer.write(json.dumps({"close": fd}).encode() + b"\n")

    def _give_up(self, reason: str) -> None:
        if not self.broken:
            self.broken = reason
            if not self._closing:
                log.warning("workers start cold from now on: %s", reason)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        assert self._ready is not None
        try:
            while line := await reader.readline():
                message = json.loads(line)
                if "ready" in message or "refused" in message:
                    if message.get("refused"):
                        self._give_up(message["refused"])
                    self._ready.set_result(message.get("refused", ""))
                elif "spawned" in message:
                    process = ForkedProcess(message["pid"]) if "pid" in message else None
                    if process is not None:
                        self._processes[process.pid] = process
                    else:
                        log.warning("the warm interpreter could not fork: %s", message["error"])
                    waiting = self._pending.pop(message["spawned"], None)
                    if waiting is not None and not waiting.done():
                        waiting.set_result(process)
                elif "exited" in message:
                    process = self._processes.pop(message["exited"], None)
                    if process is not None:
                        process.exited(message["returncode"])
        finally:
            self._zygote_gone()

    def _zygote_gone(self) -> None:
        """Its children die with it (a parent-death signal); make sure, and say so."""
        code = self._zygote.returncode if self._zygote is not None else None
        self._give_up(f"the warm interpreter exited (code {code})" if code is not None
                      else "the warm interpreter closed its socket")
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(self.broken)
        for waiting in self._pending.values():
            if not waiting.done():
                waiting.set_result(None)
        self._pending.clear()
        for process in self._processes.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.exited(-signal.SIGKILL)
        self._processes.clear()

    async def close(self) -> None:
        """End the zygote (its remaining children with it): after the workers are stopped."""
        self._closing = True
        if self._writer is not None:
            self._writer.close()
        if self._zygote is not None and self._ready is not None and not self._ready.done():
            self._zygote.kill()  # still importing, so no worker of it to wait for
        if self._zygote is not None and self._zygote.returncode is None:
            try:
                await asyncio.wait_for(self._zygote.wait(), 5)
            except TimeoutError:
                self._zygote.kill()
                await self._zygote.wait()
        if self._reader_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task


async def settle_warm(warm: WarmStarter | None, command: list[str], enabled: bool
                      ) -> WarmStarter | None:
    """Once the job's command is known: the warm interpreter its workers fork from, or None
    (it is closed: they start cold), saying why."""
    decision = decide_warm_start(command, sys.executable, enabled)
    log.info("%s", decision.reason)
    if decision.target is None:
        if warm is not None:
            await warm.close()
        return None
    if warm is not None:
        warm.target = decision.target
    return warm
