"""Recovery-latency benchmark: inject many worker kills, measure detect and recover times.

    python benchmarks/recovery.py --out /tmp/bench-recovery [--runs 10]

Every run is a real `recover run` (controller, 2 agents, 4 workers as separate
processes) of 12 steps at the demo sizes (-M 16 -B 8, default model) with
three SIGKILLs injected through `--kill`. Runs alternate between two shapes:

* single-kill runs: three kills at steps 2, 5 and 8, phases rotating over
  forward / backward / reduce / commit;
* double-kill runs: one kill at step 3, then at step 7 a kill in
  forward / backward / reduce followed by a second kill of another replica in
  the same step while the job recovers from the first (phase rebuild or
  recompute, alternating).

Victim replicas rotate between runs (each run kills three of the four, so one
survives). For every failure in every summary.json we collect detected_s
(kill -> controller knows) and recovered_s (kill -> every survivor computes
again in the new generation), and report n / p50 / p99 / max / mean, overall
and per phase, in DIR/results.json. Percentiles use linear interpolation
between order statistics (numpy's default); with a few dozen samples p99 is
close to the max and should be read as "the worst we saw".

Each run's files (summary.json, logs/) stay in DIR/run-NN/. Progress goes to
stderr, one line per run; the tables go to stdout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PRIMARY = ["forward", "backward", "reduce", "commit"]
IN_STEP = ["forward", "backward", "reduce"]  # a commit kill may commit first: no 2nd kill in that step
SECONDARY = ["rebuild", "recompute"]
REPLICAS = 4
STEPS = 12


def schedule(run: int) -> list[dict[str, Any]]:
    """The kills of run `run`: three distinct victims, deterministic."""
    victims = [(run + i) % REPLICAS for i in range(3)]
    if run % 2 == 0:
        k = run // 2
        return [{"step": step, "replica": victim, "phase": PRIMARY[(3 * k + j) % 4]}
                for j, (step, victim) in enumerate(zip((2, 5, 8), victims, strict=True))]
    k = run // 2
    return [
        {"step": 3, "replica": victims[0], "phase": PRIMARY[(k + 3) % 4]},
        {"step": 7, "replica": victims[1], "phase": IN_STEP[k % 3]},
        {"step": 7, "replica": victims[2], "phase": SECONDARY[k % 2]},
    ]


def spec(kill: dict[str, Any]) -> str:
    return f"step={kill['step']},replica={kill['replica']},phase={kill['phase']}"


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy.percentile's default)."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def stats(values: list[float | None]) -> dict[str, Any]:
    known = [v for v in values if v is not None]
    out: dict[str, Any] = {"n": len(known), "missing": len(values) - len(known)}
    if known:
        out.update(p50_s=round(percentile(known, 50), 4), p99_s=round(percentile(known, 99), 4),
                   max_s=round(max(known), 4), mean_s=round(statistics.fmean(known), 4),
                   min_s=round(min(known), 4))
    return out


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return {"nproc": os.cpu_count(), "cpu_model": cpu, "python": platform.python_version(),
            "torch": torch_version, "platform": platform.platform()}


def git_revision() -> str | None:
    """HEAD of the checkout this benchmark measures, with "+dirty" if it has local changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) or None


def foreign_load() -> dict[str, Any]:
    """Load average and other ReCoVer jobs / test runs on this machine right now (noise check)."""
    others = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "recover.cli.main controller" in cmd or "recover.trainer.worker" in cmd or "pytest" in cmd:
            others += 1
    return {"loadavg_1m": round(os.getloadavg()[0], 2), "other_recover_or_pytest_processes": others}


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return found


def stop_job(proc: subprocess.Popen[str]) -> None:
    """Stop a `recover run` and everything it started.

    SIGINT first: the launcher then stops its controller and agents (each in a
    session of its own, so they would outlive a killed launcher). If it is still
    there after 20 s, SIGKILL the process groups of its children (an agent's
    group holds its workers), then the launcher.
    """
    kids = _children(proc.pid)
    proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        for kid in kids:
            try:
                os.killpg(kid, signal.SIGKILL)
            except OSError:
                pass
        proc.kill()
        proc.communicate()


def run_one(index: int, out: Path, timeout_s: float, group_timeout: float | None = None) -> dict[str, Any]:
    kills = schedule(index)
    noise = foreign_load()  # before our job starts: every process it counts is someone else's
    run_dir = out / f"run-{index:02d}"
    argv = [sys.executable, "-m", "recover.cli.main", "run", "--replicas", str(REPLICAS),
            "--steps", str(STEPS), "-M", "16", "-B", "8", "--seed", str(index),
            "--out", str(run_dir), "--quiet"]
    for kill in kills:
        argv += ["--kill", spec(kill)]
    if group_timeout is not None:
        argv += ["--group-timeout", str(group_timeout)]
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        rc: int | None = proc.returncode
        tail = output.strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        stop_job(proc)
        rc, tail = None, [f"timed out after {timeout_s:.0f}s"]
    elapsed = time.monotonic() - started
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return {"run": index, "kills": [spec(k) for k in kills], "rc": rc, "elapsed_s": round(elapsed, 2),
            "tail": tail, "summary": summary, "noise_before": noise}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for run-NN/ and results.json")
    parser.add_argument("--runs", type=int, default=10, help="runs of 3 kills each (default 10)")
    parser.add_argument("--timeout", type=float, default=90.0,
                        help="per-run limit in seconds (a run normally takes ~10 s; default 90). "
                             "A run that hits it counts its kills as failures with unknown latency")
    parser.add_argument("--group-timeout", type=float, default=None,
                        help="pass --group-timeout to `recover run` (default: recover's own, 30 s)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Started in the background by a non-interactive shell, this process (and so
    # every child) would ignore SIGINT, and stop_job() relies on it: a Python
    # handler here is reset to the default in the children when they exec.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    failures: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    anomalies: list[str] = []
    bench_start = time.monotonic()
    for index in range(args.runs):
        result = run_one(index, out, args.timeout, args.group_timeout)
        s = result["summary"]
        expected = len(result["kills"])
        got = len(s["failures"]) if s else 0
        state = s["state"] if s else "no-summary"
        noise = result["noise_before"]
        line = (f"[run {index + 1}/{args.runs}] {state} rc={result['rc']} "
                f"{s['steps_committed'] if s else '?'}/{STEPS} steps, {got}/{expected} failures, "
                f"{result['elapsed_s']:.1f}s  load {noise['loadavg_1m']}"
                + (f" ({noise['other_recover_or_pytest_processes']} foreign recover/pytest procs)"
                   if noise["other_recover_or_pytest_processes"] else "")
                + f"  kills: {'; '.join(result['kills'])}")
        print(line, file=sys.stderr, flush=True)
        if state != "succeeded" or result["rc"] != 0:
            anomalies.append(f"run {index}: state {state}, rc {result['rc']}: {' | '.join(result['tail'])}")
        if s and got != expected:
            anomalies.append(f"run {index}: {got} failures recorded for {expected} kills")
        entry = {k: v for k, v in result.items() if k not in ("summary", "tail")}
        if s:
            entry.update(state=s["state"], steps_committed=s["steps_committed"], wall_s=s["wall_s"],
                         train_s=s["train_s"], step_time=s["step_time"],
                         param_sha256_agreed=all(d is not None for d in s["param_sha256_per_step"]))
            for f in s["failures"]:
                failures.append({"run": index, **f})
                if f["detected_s"] is None or f["recovered_s"] is None:
                    anomalies.append(f"run {index}: failure {f} has a null latency")
                if f["cause"] != "injected":
                    anomalies.append(f"run {index}: failure with cause {f['cause']}: {f}")
        else:
            # No summary (the run hung past --timeout): its kills count as failures
            # whose latencies are unknown, so they show up as "missing", not vanish.
            for kill in schedule(index):
                failures.append({"run": index, **kill, "cause": "injected", "detected_s": None,
                                 "recovered_s": None, "note": "run produced no summary"})
        runs.append(entry)

    phases = sorted({f["phase"] for f in failures}, key=lambda p: (PRIMARY + SECONDARY + [p]).index(p))
    known = [f["recovered_s"] for f in failures if f["recovered_s"] is not None]
    p50 = percentile(known, 50) if known else 0.0
    outliers = [f for f in failures if f["recovered_s"] is not None and f["recovered_s"] > 3 * p50]
    for f in outliers:
        anomalies.append(f"run {f['run']}: outlier recovered_s {f['recovered_s']} (> 3 x p50) "
                         f"phase {f['phase']} step {f['step']} replica {f['replica']}")
    result = {
        "benchmark": "recovery",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine(),
        "git": git_revision(),
        "config": {"replicas": REPLICAS, "steps": STEPS, "global_microbatches": 16,
                   "microbatch_size": 8, "model": "default", "agents": 2, "runs": args.runs,
                   "group_timeout_s": args.group_timeout or "recover default (30)",
                   "timeout_s": args.timeout},
        "bench_wall_s": round(time.monotonic() - bench_start, 1),
        "n_failures": len(failures),
        "detect": {"overall": stats([f["detected_s"] for f in failures]),
                   "per_phase": {p: stats([f["detected_s"] for f in failures if f["phase"] == p])
                                 for p in phases}},
        "recover": {"overall": stats([f["recovered_s"] for f in failures]),
                    "per_phase": {p: stats([f["recovered_s"] for f in failures if f["phase"] == p])
                                  for p in phases}},
        "anomalies": anomalies,
        "runs": runs,
        "failures": failures,
    }
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")

    m = result["machine"]
    print(f"recovery benchmark, {result['date']}: {m['nproc']} cpus ({m['cpu_model']}), "
          f"python {m['python']}, torch {m['torch']}, git {result['git']}")
    print(f"{len(failures)} failures over {args.runs} runs ({result['bench_wall_s']}s)")
    header = f"{'phase':<10} {'n':>3} {'miss':>4}  {'detect p50':>10} {'p99':>7} {'max':>7} {'mean':>7}   " \
             f"{'recover p50':>11} {'p99':>7} {'max':>7} {'mean':>7}"
    print(header)

    def row(name: str, d: dict[str, Any], r: dict[str, Any]) -> str:
        def cells(x: dict[str, Any], w: int) -> str:
            if not x["n"]:
                return f"{'-':>{w}} {'-':>7} {'-':>7} {'-':>7}"
            return f"{x['p50_s']:>{w}.3f} {x['p99_s']:>7.3f} {x['max_s']:>7.3f} {x['mean_s']:>7.3f}"
        return f"{name:<10} {d['n'] + d['missing']:>3} {r['missing']:>4}  {cells(d, 10)}   {cells(r, 11)}"

    print(row("overall", result["detect"]["overall"], result["recover"]["overall"]))
    for p in phases:
        print(row(p, result["detect"]["per_phase"][p], result["recover"]["per_phase"][p]))
    if anomalies:
        print("anomalies:")
        for a in anomalies:
            print(f"  {a}")
    print(f"results: {out / 'results.json'}")
    failed = sum(1 for r in runs if r.get("state") != "succeeded" or r["rc"] != 0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
