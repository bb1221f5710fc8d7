"""The single-process mode (trainer/standalone.py): `python examples/minimal.py` by hand.

Real processes, because that is the feature: the script starts `recover run --attach` (a
launcher, a controller, an agent) and trains in its own process. One job by hand and one
by `recover run` check the whole story: the notice, the summary, the training in the
script's own process, bitwise the same as `recover run --replicas 1` in exact mode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.integration.conftest import REPO, assert_bitwise_identical, run_recover

ARGS = ["--steps", "4", "-M", "4", "--seed", "2", "--reduce", "exact"]
SCRIPT = str(REPO / "examples" / "minimal.py")


def by_hand(out: Path, **env: str) -> tuple[subprocess.Popen[str], str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RECOVER_")}
    environ.update(RECOVER_OUT=str(out), **env)
    proc = subprocess.Popen([sys.executable, SCRIPT, "--hidden", "16"], env=environ, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = proc.communicate(timeout=180)
    return proc, stdout, stderr


def test_a_script_run_by_hand_trains_here_as_recover_run_would(tmp_path: Path) -> None:
    proc, stdout, stderr = by_hand(tmp_path / "by-hand", RECOVER_ARGS=" ".join(ARGS))
    assert proc.returncode == 0, stderr
    assert stderr.startswith("recover: not started by `recover run`: training here as its one "
                             "replica (recover run --replicas 1 --steps 4 -M 4"), stderr
    summary = json.loads((tmp_path / "by-hand" / "summary.json").read_text())
    assert summary["state"] == "succeeded" and summary["steps_committed"] == 4
    log = (tmp_path / "by-hand" / "logs" / "controller.log").read_text()
    assert f"replica-ready: pid {proc.pid}," in log  # the script's own process trained
    reference = run_recover(tmp_path / "recover-run", "--replicas", "1", *ARGS, "--quiet",
                            "--", "python", SCRIPT, "--hidden", "16")
    assert reference.returncode == 0, reference.stderr
    assert_bitwise_identical(summary, reference.summary)


def test_turned_off_it_is_one_line_and_exit_2(tmp_path: Path) -> None:
    proc, stdout, stderr = by_hand(tmp_path / "off", RECOVER_STANDALONE="0")
    assert proc.returncode == 2 and stdout == ""
    assert stderr.strip().splitlines() == [
        "recover: recover.trainer.init(): this script must be started by `recover run ... -- "
        "python SCRIPT` or `recover agent` (RECOVER_REPLICA_ID and RECOVER_AGENT_ADDR are not "
        "set; RECOVER_STANDALONE=0 turns off training here as one local replica)"]
    assert not (tmp_path / "off").exists()
