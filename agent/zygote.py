"""The warm interpreter an agent forks its workers from: `python -m recover.agent.zygote`.

A worker started cold pays interpreter start and `import torch` (about 3 s of CPU on the
2-core test machine) before it can even connect, and a restarted worker pays it on cores
the survivors keep busy. This process pays it once per agent: it imports what every worker
imports, then forks one child per worker on the agent's request, and the child becomes the
worker exactly as `python SCRIPT ARGS` or `python -m MODULE ARGS` would run it, with the
worker's own environment, session, log file and working directory.

Safe to fork because nothing here has started a thread, a gRPC channel or CUDA: the
zygote checks its thread count after the imports and refuses to fork if a preloaded module
started one (the agent then starts workers cold). It dies with the agent (a parent-death
signal) and its children die with it, so nothing outlives a lost host.

Protocol, one JSON object per line over the socket inherited as `--control-fd`:
  agent -> zygote  {"spawn": N, "target": [...], "env": {...}, "cwd": "...", "log": PATH|null}
                   {"close": FD}       (an inherited descriptor the job does not need)
  zygote -> agent  {"ready": true} | {"refused": REASON}         once, after the imports
                   {"spawned": N, "pid": PID} | {"spawned": N, "error": REASON}
                   {"exited": PID, "returncode": RC}    (negative: killed by that signal)
The agent closing the socket ends the zygote.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import runpy
import select
import socket
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

from recover.common.lifetime import die_with_parent

PRELOAD_ENV = "RECOVER_PRELOAD"
"""Comma-separated modules of the user's to import too (e.g. transformers): a worker's own
heavy imports, paid once per agent instead of once per worker and restart."""
PRELOAD = ("torch", "torch.distributed", "torch.nn", "torch.optim", "torch._dynamo", "grpc",
           "recover.trainer.api", "recover.trainer.executor")
"""What every worker imports before it can train (torch._dynamo: every torch.optim
optimizer's constructor imports it, 2 s of CPU here). A module a script does not use costs
the child nothing: it is already in memory, shared copy-on-write."""


@dataclass(frozen=True)
class WorkerSpec:
    """What the agent asked this child to become."""

    target: list[str]
    """["-m", MODULE, *ARGS] or [SCRIPT, *ARGS]: the command after the interpreter."""
    env: dict[str, str]
    cwd: str
    log: str | None
    """The worker's log file (stdout and stderr, appended); None: the zygote's own."""


def _end() -> NoReturn:
    """Exit at once: the zygote holds nothing to save, and tearing down an interpreter with
    torch imported takes a quarter second that the agent's shutdown would wait for."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(0)


def _send(control: socket.socket, message: dict[str, object]) -> None:
    control.sendall(json.dumps(message).encode() + b"\n")


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def preload(modules: tuple[str, ...] = PRELOAD, optional: tuple[str, ...] = ()) -> str:
    """Import `modules`, then the user's `optional` ones (RECOVER_PRELOAD: one that fails is
    left to the workers, saying so); an empty string when forking is safe, else the reason
    it is not."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 (any import failure means: start cold)
            return f"importing {name} failed: {type(exc).__name__}: {exc}"
    for name in optional:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 (the workers will meet it themselves)
            print(f"recover zygote: RECOVER_PRELOAD: importing {name} failed "
                  f"({type(exc).__name__}: {exc}); the workers import it themselves",
                  file=sys.stderr, flush=True)
    threads = _thread_count()
    if threads > 1:
        # A child forked now would inherit locks those threads may hold.
        return (f"the preloaded modules started {threads - 1} thread(s) (OMP_NUM_THREADS or "
                "OPENBLAS_NUM_THREADS above 1?)")
    return ""


def serve(control: socket.socket) -> WorkerSpec:
    """Fork workers on request and report their exits; returns only in a forked child."""
    children: dict[int, int] = {}  # pidfd -> pid
    pending = b""
    while True:
        readable, _, _ = select.select([control.fileno(), *children], [], [])
        for fd in readable:
            if fd != control.fileno():
                pid = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                _send(control, {"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})
                continue
            data = control.recv(65536)
            if not data:  # the agent is gone or done: our children go with us
                _end()
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                if "close" in request:
                    with contextlib.suppress(OSError):
                        os.close(int(request["close"]))
                    continue
                spec = _fork(request, control, children)
                if spec is not None:
                    return spec


def _fork(request: dict[str, Any], control: socket.socket,
          children: dict[int, int]) -> WorkerSpec | None:
    """Fork the requested worker: its spec in the child, None in the zygote (which tells the
    agent the pid, or why there is none, and watches the child's exit)."""
    spec = WorkerSpec(target=list(request["target"]), env=dict(request["env"]),
                      cwd=str(request["cwd"]), log=request.get("log"))
    try:
        pid = os.fork()
    except OSError as exc:
        _send(control, {"spawned": request["spawn"], "error": str(exc)})
        return None
    if pid == 0:
        for pidfd in children:
            os.close(pidfd)
        control.close()
        return spec
    children[os.pidfd_open(pid)] = pid
    _send(control, {"spawned": request["spawn"], "pid": pid})
    return None


def _output_to(path: str) -> None:
    """stdout and stderr of this process append to `path` from now on."""
    log = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)


def become(spec: WorkerSpec, zygote: int) -> None:
    """Turn this forked child into the worker the agent asked for."""
    os.setsid()  # a process group of its own: the agent kills the worker's whole group
    if not die_with_parent(zygote):
        os._exit(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if spec.log is not None:
        _output_to(spec.log)
    os.environ.clear()
    os.environ.update(spec.env)
    os.chdir(spec.cwd)


def run(target: list[str]) -> None:
    """Run the worker as the interpreter would have (sys.argv, sys.path[0], __main__)."""
    if target[0] == "-m":
        sys.argv = [target[1], *target[2:]]  # run_module puts the module's file in argv[0]
        sys.path[0] = os.getcwd()
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        script = target[0]
        sys.argv = list(target)
        sys.path[0] = os.path.dirname(os.path.realpath(script))
        runpy.run_path(script, run_name="__main__")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m recover.agent.zygote")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--agent-pid", type=int, required=True)
    parser.add_argument("--preload", default=",".join(PRELOAD),
                        help="comma-separated modules to import before forking")
    parser.add_argument("--log", default=None,
                        help="append this process's output here (its forked workers write their "
                             "own); in the command line, so `ps` shows whose zygote it is")
    args = parser.parse_args()
    if args.log is not None:
        _output_to(args.log)
    control = socket.socket(fileno=args.control_fd)
    if not die_with_parent(args.agent_pid):
        raise SystemExit(0)
    extra = os.environ.get(PRELOAD_ENV, "")
    refused = preload(tuple(name for name in args.preload.split(",") if name),
                      tuple(name.strip() for name in extra.split(",") if name.strip()))
    try:
        _send(control, {"refused": refused} if refused else {"ready": True})
    except OSError:  # the agent ended while we imported
        _end()
    if refused:
        _end()
    gc.freeze()  # children leave these objects alone: fewer copied pages, shorter collections
    zygote = os.getpid()
    try:
        spec = serve(control)
    except (OSError, ValueError):  # the agent is gone (or sent what it never sends): end
        _end()
    become(spec, zygote)
    try:
        run(spec.target)
    finally:
        # The interpreter's teardown collects every object again, several times: with
        # torch's imported that takes 0.3-0.7 s, which the job's end waits for. The garbage
        # the worker left is collected (its finalizers run) and the rest is frozen, so the
        # teardown skips it (objects alive at exit get no guarantee of finalization anyway).
        gc.collect()
        gc.freeze()


if __name__ == "__main__":
    main()
