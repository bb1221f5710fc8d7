"""agent/warmstart.py and agent/zygote.py: which commands fork from the warm interpreter, and
a real zygote (preloading nothing, so each test takes a fraction of a second) forking workers
that behave as `python SCRIPT` / `python -m MODULE` would. Real processes because the
mechanism is processes: fork, sessions, exit statuses, parent-death signals."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from recover.agent.warmstart import WarmDecision, WarmStarter, decide_warm_start

PY = sys.executable


@pytest.mark.parametrize("command, target, reason", [
    ([PY, "train.py", "--lr", "1"], ["train.py", "--lr", "1"],
     "workers fork from a warm interpreter (script train.py)"),
    ([PY, "-m", "pkg.train", "-x"], ["-m", "pkg.train", "-x"],
     "workers fork from a warm interpreter (module pkg.train)"),
    ([PY, "-u", "train.py"], None,
     "workers start cold: interpreter option -u needs a fresh interpreter"),
    ([PY, "-m"], None, "workers start cold: interpreter option -m needs a fresh interpreter"),
    ([PY], None, "workers start cold: the command names no script or module"),
    (["./train.sh", "a"], None,
     f"workers start cold: ./train.sh is not the agent's interpreter ({PY})"),
    ([], None, "no worker command"),
])
def test_which_commands_fork_warm(command: list[str], target: list[str] | None,
                                  reason: str) -> None:
    assert decide_warm_start(command, PY) == WarmDecision(target, reason)


def test_cold_start_when_turned_off() -> None:
    assert decide_warm_start([PY, "train.py"], PY, enabled=False) == WarmDecision(
        None, "workers start cold (--cold-start)")


REPORTER = """
import json, os, sys
print(json.dumps({"name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
                  "env": os.environ.get("WORKER_VAR"), "sid": os.getsid(0) == os.getpid(),
                  "stdin": sys.stdin.read()}))
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
"""


def _starter(target: list[str], tmp_path: Path, preload: tuple[str, ...] = ()) -> WarmStarter:
    starter = WarmStarter(dict(os.environ), tmp_path / "zygote.log", preload=preload)
    starter.target = target
    return starter


async def _spawn_and_wait(starter: WarmStarter, tmp_path: Path, name: str,
                          **env: str) -> tuple[int, str]:
    log = tmp_path / f"{name}.log"
    process = await starter.spawn(dict(os.environ, **env), str(tmp_path), log)
    assert process is not None, starter.broken
    code = await asyncio.wait_for(process.wait(), 30)
    return code, log.read_text()


def test_a_forked_script_runs_as_python_script_would(tmp_path: Path) -> None:
    script = tmp_path / "sub" / "report.py"
    script.parent.mkdir()
    script.write_text(REPORTER)

    async def scenario() -> None:
        starter = _starter([str(script), "--flag", "1"], tmp_path)
        await starter.start()
        try:
            code, out = await _spawn_and_wait(starter, tmp_path, "a", WORKER_VAR="a",
                                              EXIT_CODE="3")
            assert code == 3
            seen = json.loads(out)
            assert seen == {"name": "__main__", "argv": [str(script), "--flag", "1"],
                            "cwd": str(tmp_path), "path0": str(script.parent), "env": "a",
                            "sid": True, "stdin": ""}
            # A second worker from the same zygote gets its own environment.
            code, out = await _spawn_and_wait(starter, tmp_path, "b", WORKER_VAR="b")
            assert code == 0 and json.loads(out)["env"] == "b"
        finally:
            await starter.close()

    asyncio.run(scenario())


def test_a_forked_module_runs_as_python_m_would(tmp_path: Path) -> None:
    (tmp_path / "reportmod.py").write_text(REPORTER)

    async def scenario() -> None:
        starter = _starter(["-m", "reportmod", "x"], tmp_path)
        await starter.start()
        try:
            code, out = await _spawn_and_wait(starter, tmp_path, "m")
            seen = json.loads(out)
            assert code == 0
            assert seen["name"] == "__main__"
            assert seen["argv"] == [str(tmp_path / "reportmod.py"), "x"]
            assert seen["path0"] == str(tmp_path)
        finally:
            await starter.close()

    asyncio.run(scenario())


def test_exceptions_and_signals_give_the_exit_status_a_cold_process_would(tmp_path: Path) -> None:
    script = tmp_path / "die.py"
    script.write_text("import os, signal, sys\n"
                      "if sys.argv[1] == 'raise': raise RuntimeError('user bug')\n"
                      "os.kill(os.getpid(), signal.SIGKILL)\n")

    async def scenario() -> None:
        for how, want in (("raise", 1), ("kill", -signal.SIGKILL)):
            starter = _starter([str(script), how], tmp_path)
            await starter.start()
            try:
                code, out = await _spawn_and_wait(starter, tmp_path, how)
                assert code == want, out
                if how == "raise":
                    assert "RuntimeError: user bug" in out
            finally:
                await starter.close()

    asyncio.run(scenario())


def test_a_lost_zygote_takes_its_workers_and_later_workers_start_cold(tmp_path: Path) -> None:
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(60)\n")

    async def scenario() -> None:
        starter = _starter([str(script)], tmp_path)
        await starter.start()
        try:
            process = await starter.spawn(dict(os.environ), str(tmp_path), None)
            assert process is not None
            assert starter._zygote is not None
            starter._zygote.kill()
            assert await asyncio.wait_for(process.wait(), 30) == -signal.SIGKILL
            with pytest.raises(ProcessLookupError):  # really gone, not just reported so
                for _ in range(200):
                    os.kill(process.pid, 0)
                    await asyncio.sleep(0.05)
            assert "the warm interpreter" in starter.broken
            assert await starter.spawn(dict(os.environ), str(tmp_path), None) is None
        finally:
            await starter.close()

    asyncio.run(scenario())


def test_a_zygote_that_cannot_preload_refuses_and_workers_start_cold(tmp_path: Path) -> None:
    async def scenario() -> None:
        starter = _starter(["x.py"], tmp_path, preload=("no_such_module_for_recover",))
        await starter.start()
        try:
            assert await starter.spawn(dict(os.environ), str(tmp_path), None) is None
            assert starter.broken.startswith("importing no_such_module_for_recover failed")
        finally:
            await starter.close()

    asyncio.run(scenario())


def test_the_users_own_preloads_are_imported_once_and_a_failing_one_is_skipped(
        tmp_path: Path) -> None:
    script = tmp_path / "check.py"
    script.write_text("import sys\nprint('xml.dom.minidom' in sys.modules)\n")

    async def scenario() -> None:
        env = dict(os.environ, RECOVER_PRELOAD="xml.dom.minidom, no_such_module_for_recover")
        starter = WarmStarter(env, tmp_path / "zygote.log", preload=())
        starter.target = [str(script)]
        await starter.start()
        try:
            code, out = await _spawn_and_wait(starter, tmp_path, "w")
            assert (code, out.strip()) == (0, "True")  # imported before the fork
        finally:
            await starter.close()
        assert "RECOVER_PRELOAD: importing no_such_module_for_recover failed" in (
            tmp_path / "zygote.log").read_text()

    asyncio.run(scenario())


def test_an_inherited_socket_reaches_workers_until_the_zygote_forgets_it(tmp_path: Path) -> None:
    """The agent's listening socket for a spanning replica's store: forked workers hold it
    (rank 0 serves the store on it); a job that does not span agents has it closed in the
    zygote, so no later worker holds it."""
    script = tmp_path / "holds.py"
    script.write_text("import os, sys\n"
                      "try:\n    os.fstat(int(os.environ['FD']))\nexcept OSError:\n"
                      "    sys.exit(1)\n")

    async def scenario() -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        starter = _starter([str(script)], tmp_path)
        await starter.start((listener.fileno(),))
        try:
            fd = str(listener.fileno())
            assert (await _spawn_and_wait(starter, tmp_path, "a", FD=fd))[0] == 0
            starter.forget(listener.fileno())
            assert (await _spawn_and_wait(starter, tmp_path, "b", FD=fd))[0] == 1
        finally:
            await starter.close()
            listener.close()

    asyncio.run(scenario())
