"""CPU time the control plane costs per failure-free step (controller, agents, launcher).

    python bench/scripts/control_plane_cpu.py [--short 100] [--long 300] [--out runs/bench-cpu]
        [--relays N]

Runs the demo job (`recover run`, 4 replicas on 2 agents, -M 16 -B 8, no faults) twice,
for `--short` and `--long` steps, and samples every process's utime + stime from
/proc/PID/stat every 0.2 s until it exits; the last sample of each process is its
total (with `--relays N`, the agents reach the controller through N rack relays, whose
CPU is reported as `relay`). Start-up (imports, rendezvous, spawning) costs the same in both
runs, so
(long - short) / (long - short steps) is the steady cost per step of each kind of
process. On a machine whose cores the workers saturate, the control plane's CPU is
taken from the workers; with accelerator-like compute it is taken from idle cores.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SUBCOMMANDS = {"run": "launcher", "controller": "controller", "agent": "agent", "relay": "relay"}
WORKER_MODULE = "recover.workloads.tinygpt"
"""The demo job's workers run `python -m WORKER_MODULE FLAGS` (the built-in reference GPT)."""


def _kind(argv: list[str]) -> str | None:
    """worker, controller, agent, launcher or None, from a process's own argv (an agent's
    argv also holds its workers' command after `--`, so only the head counts)."""
    for i, token in enumerate(argv[:4]):
        if token == WORKER_MODULE:
            return "worker"
        if (token == "recover.cli.main" or token.endswith("/recover")) and i + 1 < len(argv):
            return SUBCOMMANDS.get(argv[i + 1])
    return None


def cpu_by_kind(argv: list[str]) -> tuple[dict[str, float], float]:
    """Run `argv` and return (CPU seconds per process kind, wall seconds)."""
    tick = os.sysconf("SC_CLK_TCK")
    last: dict[int, tuple[str, float]] = {}
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    while proc.poll() is None:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode().split("\0")
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # exited meanwhile
                continue
            kind = _kind(argv)
            if kind is not None:
                last[int(entry)] = (kind, (int(fields[11]) + int(fields[12])) / tick)
        time.sleep(0.2)
    if proc.returncode != 0:
        raise SystemExit(f"recover run failed: {proc.stderr.read().decode() if proc.stderr else ''}")
    totals: dict[str, float] = collections.defaultdict(float)
    for kind, seconds in last.values():
        totals[kind] += seconds
    return dict(totals), time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", type=int, default=100, help="steps of the short run")
    parser.add_argument("--long", type=int, default=300, help="steps of the long run")
    parser.add_argument("--out", default="runs/bench-cpu")
    parser.add_argument("--relays", type=int, default=0, help="rack relays in front of the "
                        "controller (`recover run --relays`)")
    args = parser.parse_args()
    if args.long <= args.short:
        parser.error("--long must be larger than --short")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {}
    for steps in (args.short, args.long):
        print(f"running {steps} steps ...", flush=True)
        cpu, wall = cpu_by_kind([sys.executable, "-m", "recover.cli.main", "run", "--steps",
                                 str(steps), "--quiet", "--out", str(out / f"run-{steps}"),
                                 "--relays", str(args.relays)])
        summary = json.loads((out / f"run-{steps}" / "summary.json").read_text())
        runs[steps] = {"cpu_s": cpu, "wall_s": round(wall, 2), "step_time": summary["step_time"]}
    extra = args.long - args.short
    per_step_ms = {kind: round(1000 * (runs[args.long]["cpu_s"].get(kind, 0.0)
                                       - runs[args.short]["cpu_s"].get(kind, 0.0)) / extra, 2)
                   for kind in ("worker", "controller", "agent", "relay", "launcher")}
    result = {"relays": args.relays, "runs": runs, "cpu_ms_per_step": per_step_ms,
              "control_plane_cpu_ms_per_step": round(sum(v for k, v in per_step_ms.items()
                                                         if k != "worker"), 2),
              "step_median_s": runs[args.long]["step_time"]["median_s"]}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
