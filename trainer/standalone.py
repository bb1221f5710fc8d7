"""`python train.py` outside ReCoVer: the job as one local replica, trained in this process.

A script that calls `rt.init()` without having been started by an agent starts
`recover run --replicas 1 --attach PID` as a child (a controller and an agent, each a
process of its own as always) and becomes that job's one worker itself: the training runs
here, so `pdb`, `breakpoint()`, stdin and the script's own output work as they would in a
plain torch loop, and the job is the same as `recover run --replicas 1 -- python train.py`
(the same summary, the same ledger; bitwise the same in exact mode). The launcher writes
the summary when the job ends; `train()` waits for it before it returns.

Settings: `RECOVER_ARGS` (flags for `recover run`, e.g. "--steps 20 -M 8 --reduce exact"),
`RECOVER_OUT` (where the summary and logs go; default runs/local). `RECOVER_STANDALONE=0`
refuses instead (the script exits 2, as it did before this mode existed).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ATTACH_FILE = "attach.json"
FINISH_WAIT_S = 60.0
"""How long the end of train() waits for the launcher to write the summary."""

_launcher: subprocess.Popen[bytes] | None = None


class NotStandalone(Exception):
    """The single-process mode cannot start; the message says why (one line)."""


def enabled() -> bool:
    return os.environ.get("RECOVER_STANDALONE", "1") != "0"


def attach() -> None:
    """Start the local job for this process and put its worker identity in the environment
    (RECOVER_REPLICA_ID, RECOVER_AGENT_ADDR, ...), as an agent would have."""
    global _launcher
    out = Path(os.environ.get("RECOVER_OUT", "runs/local"))
    try:
        flags = shlex.split(os.environ.get("RECOVER_ARGS", ""))
    except ValueError as exc:
        raise NotStandalone(f"RECOVER_ARGS does not parse: {exc}") from None
    attach_file = out / ATTACH_FILE
    attach_file.unlink(missing_ok=True)
    command = [sys.executable, "-m", "recover.cli.main", "run", "--replicas", "1", "--quiet",
               "--out", str(out), "--attach", str(os.getpid()), *flags,
               "--", sys.executable, *sys.argv]
    as_run = shlex.join(["recover", "run", "--replicas", "1", *flags])
    print(f"recover: not started by `recover run`: training here as its one replica "
          f"({as_run}); summary and logs in {out}", file=sys.stderr, flush=True)
    # Its own session: a Ctrl-C at a pdb prompt here must not stop the job. It ends with the
    # job, which ends when this process does (the agent watches it).
    _launcher = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True)
    while not attach_file.exists():
        if _launcher.poll() is not None:
            raise NotStandalone(f"the local job did not start (recover run exited with code "
                                f"{_launcher.returncode}; see above)")
        time.sleep(0.05)
    identity = json.loads(attach_file.read_text())
    os.environ.update({
        "RECOVER_REPLICA_ID": str(identity["replica"]),
        "RECOVER_SLOT": str(identity["slot"]),
        "RECOVER_AGENT_ADDR": identity["agent_address"],
        "RECOVER_TRANSFER_HOST": identity["transfer_host"],
        "RECOVER_ATTACHED": "1",
    })


def finish() -> None:
    """Wait for the launcher to write the summary (after the job's end)."""
    if _launcher is not None:
        try:
            _launcher.wait(FINISH_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
