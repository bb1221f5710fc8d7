"""Hang watchdog: time from a worker's hang to the survivors computing again.

    python bench/scripts/watchdog.py --out /tmp/bench-watchdog [--runs 8] [--hang-timeout 2.0]

Each run is `recover run --replicas 4 --steps 10 -M 16 -B 8` with three hung
workers at steps 2, 5 and 8 (kinds rotate over stop = SIGSTOP, spin = an
endless Python loop, deadlock = a lock acquired twice; victims rotate so one
replica always survives). Per hang it reads `detected_s` (the hang's start,
stamped by the worker, → the controller knowing: the watchdog's bound plus
its poll) and `recovered_s` (→ every survivor computing again) from
`summary.json`, and reports p50/p99 overall and per kind. The bound is
`max(--hang-timeout, --hang-factor x typical microbatch)`, so with the
default 2 s and ~20 ms microbatches the expected figure is just over 2 s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from recover.bench.env import foreign_load, git_revision, machine
from recover.bench.recovery import stats

KINDS = ["stop", "spin", "deadlock"]
REPLICAS = 4
STEPS = 10


def kills(run: int) -> list[str]:
    victims = [(run + i) % REPLICAS for i in range(3)]
    return [f"step={step},replica={victim},phase={KINDS[(run + j) % 3]}"
            for j, (step, victim) in enumerate(zip((2, 5, 8), victims, strict=True))]


def run_one(index: int, out: Path, hang_timeout: float) -> dict[str, Any]:
    run_dir = out / f"run-{index:02d}"
    argv = [sys.executable, "-m", "recover.cli.main", "run", "--replicas", str(REPLICAS),
            "--steps", str(STEPS), "-M", "16", "-B", "8", "--seed", str(index), "--quiet",
            "--hang-timeout", str(hang_timeout), "--out", str(run_dir)]
    for kill in kills(index):
        argv += ["--kill", kill]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return {"run": index, "rc": proc.returncode, "kills": kills(index), "summary": summary}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for run-NN/ and results.json")
    parser.add_argument("--runs", type=int, default=8, help="runs of 3 hangs each (default 8)")
    parser.add_argument("--hang-timeout", type=float, default=2.0,
                        help="the watchdog's floor, passed to `recover run` (default 2.0)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hangs: list[dict[str, Any]] = []
    anomalies: list[str] = []
    started = time.monotonic()
    for index in range(args.runs):
        noise = foreign_load()
        result = run_one(index, out, args.hang_timeout)
        s = result["summary"]
        state = s["state"] if s else "no-summary"
        print(f"[run {index + 1}/{args.runs}] {state} rc={result['rc']} load {noise['loadavg_1m']}  "
              f"{'; '.join(result['kills'])}", file=sys.stderr, flush=True)
        if state != "succeeded":
            anomalies.append(f"run {index}: {state}, rc {result['rc']}")
        for f in s["failures"] if s else []:
            hangs.append({"run": index, **f})
            if f["cause"] != "watchdog":
                anomalies.append(f"run {index}: failure with cause {f['cause']}: {f}")
    result = {
        "benchmark": "watchdog",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine(),
        "git": git_revision(),
        "config": {"replicas": REPLICAS, "steps": STEPS, "runs": args.runs,
                   "hang_timeout_s": args.hang_timeout},
        "bench_wall_s": round(time.monotonic() - started, 1),
        "detect": {"overall": stats([h["detected_s"] for h in hangs]),
                   "per_kind": {k: stats([h["detected_s"] for h in hangs if h["phase"] == k])
                                for k in KINDS}},
        "recover": {"overall": stats([h["recovered_s"] for h in hangs]),
                    "per_kind": {k: stats([h["recovered_s"] for h in hangs if h["phase"] == k])
                                 for k in KINDS}},
        "anomalies": anomalies,
        "hangs": hangs,
    }
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{len(hangs)} hangs over {args.runs} runs ({result['bench_wall_s']}s), "
          f"bound max({args.hang_timeout} s, 10 x microbatch)")
    print("kind      n  detect p50  detect p99  recover p50  recover p99")
    for kind, d in [("overall", result["detect"]["overall"]), *result["detect"]["per_kind"].items()]:
        r = result["recover"]["overall"] if kind == "overall" else result["recover"]["per_kind"][kind]
        if d["n"]:
            print(f"{kind:9} {d['n']:2}  {d['p50_s']:9.3f}s  {d['p99_s']:9.3f}s  "
                  f"{r['p50_s']:10.3f}s  {r['p99_s']:10.3f}s")
    for line in anomalies:
        print("anomaly:", line)
    return 0 if not anomalies else 1


if __name__ == "__main__":
    sys.exit(main())
