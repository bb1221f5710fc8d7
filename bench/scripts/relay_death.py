"""A rack relay SIGKILLed mid-run: what it costs the job.

    python bench/scripts/relay_death.py --rounds 5 --out bench/results/relay-death

Real `recover run` jobs (4 replicas on 2 agents, exact mode, 30 steps, `--compute-ms 30`,
`--relays 2`: each agent given both relays, its own first), relay `rack0` SIGKILLed once 6
steps are committed. Per round: how long after the kill the leader saw the relay's stream
end (`relay-gone`), how long after that its agent was back through the other relay
(`agent-reattached`), the failures the job recorded, and the longest time between two
commits against the median (what the step around the relay's death cost).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from recover.bench.env import environment
from recover.proto import pb, rpc

JOB = ["--replicas", "4", "--steps", "30", "-M", "8", "-B", "2", "--seed", "11", "--quiet",
       "--reduce", "exact", "--agents", "2", "--relays", "2", "--compute-ms", "30"]


def committed(port_file: Path) -> int:
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port_file.read_text()}") as channel:
            return rpc.ControlStub(channel).Status(pb.StatusRequest(), timeout=2).steps_committed
    except (grpc.RpcError, FileNotFoundError, ValueError):
        return -1


def event_at(log: str, kind: str) -> float:
    found = re.search(rf'ts=([\d.]+) [^\n]*msg="{kind}', log)
    if found is None:
        raise RuntimeError(f"no {kind} event in the controller's log")
    return float(found[1])


def one_round(out: Path) -> dict[str, Any]:
    job = subprocess.Popen([sys.executable, "-m", "recover.cli.main", "run", *JOB,
                            "--job-id", "relay-death", "--out", str(out)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while committed(out / "controller.port") < 6:
        if job.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the job did not get to step 6: {job.communicate()[1][-500:]}")
        time.sleep(0.05)
    relay = subprocess.run(["pgrep", "-f", "--", "--relay-id rack0"], capture_output=True,
                           text=True).stdout.split()
    killed = time.time()
    os.kill(int(relay[0]), signal.SIGKILL)
    _, stderr = job.communicate(timeout=180)
    if job.returncode != 0:
        raise RuntimeError(f"the job failed: {stderr[-500:]}")
    log = (out / "logs" / "controller.log").read_text()
    summary = json.loads((out / "summary.json").read_text())
    times = [t for t in summary["committed_at_s_per_step"] if t is not None]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    gone = event_at(log, "relay-gone")
    return {"relay_gone_after_kill_ms": round((gone - killed) * 1e3, 1),
            "reattached_after_gone_ms": round((event_at(log, "agent-reattached") - gone) * 1e3, 1),
            "failures": len(summary["failures"]),
            "longest_between_commits_s": round(max(gaps), 4),
            "median_between_commits_s": round(statistics.median(gaps), 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rounds = []
    for index in range(args.rounds):
        rounds.append(one_round(args.out / f"r{index}"))
        print(json.dumps(rounds[-1]), flush=True)
    (args.out / "results.json").write_text(json.dumps(
        {"environment": environment(), "job": JOB, "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
