"""`recover bench recovery`: recovery latency of injected kills, overall and split by phase.

Every run is a real `recover run` (controller, 2 agents, R workers) of 12
steps at the demo sizes (-M 16 -B 8) with three SIGKILLs from `--kill`.
Runs alternate between two shapes (`schedule`):
* single kills at steps 2, 5, 8, kill phases rotating over forward, backward,
  reduce, commit;
* double kills: one at step 3, then at step 7 one in forward / backward /
  reduce and a second replica killed while the job recovers from it
  (rebuild: while survivors build the new group; recompute: while computing
  a microbatch taken over from the lost replica).
Victims rotate; one replica always survives.

Two views of the same failures:
* per failure (by kill phase): detected_s (kill -> controller knows) and
  recovered_s (kill -> every survivor computes again in the new generation);
  `p50_s` / `p99_s` are over recovered_s.
* per recovery (by recovery phase, `split`): failures that end in the same
  resumption form one recovery; its time splits into
  detect (first kill -> controller knows), plan (-> the new generation's
  broadcast, including any interrupted attempt when a second replica died
  during recovery), rebuild (-> every survivor is back at the step's work:
  plan delivery, then its next microbatch, or, with none left to compute, the
  gloo group of the new generation, which meets on a thread beside the
  compute: trainer/groups/meeting.py), recompute (-> the
  controller commits the step: the lost microbatches, the reduction and the
  reports) and commit (the median replica's commit round trip, reduced
  reported -> commit received; it overlaps recompute by one one-way message).
  detect + plan + rebuild = kill -> computing again. Same definitions as the
  controller's `recover_recovery_seconds` histogram, except rebuild, which
  the controller takes from the workers' own time from the new generation to
  being back at work.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recover.bench.env import environment, percentile
from recover.bench.recover_job import JobFailed, run_recover

KILL_PHASES = ["forward", "backward", "reduce", "commit"]
IN_STEP = ["forward", "backward", "reduce"]  # a commit kill may commit first: no 2nd kill then
SECONDARY = ["rebuild", "recompute"]
SPLIT = ["detect", "plan", "rebuild", "recompute", "commit"]
STEPS = 12


@dataclass
class RecoveryConfig:
    """One `bench recovery` invocation."""

    runs: int
    """Runs of three kills each."""
    replicas: int
    """Replicas per run (>= 4: three victims and a survivor)."""
    out: Path
    """results.json and one folder per run."""
    timeout_s: float = 90.0
    """Limit per run; a run that hits it counts its kills as failures of unknown latency."""
    global_microbatches: int = 16
    """M (at least the replicas: every replica computes one); the demo's 16 by default."""
    first_run: int = 0
    """The first run's number: the kill schedule rotates with it (rounds of a few runs)."""


def schedule(run: int, replicas: int) -> list[dict[str, Any]]:
    """The three kills of run `run`: distinct victims, deterministic (pure)."""
    victims = [(run + i) % replicas for i in range(3)]
    k = run // 2
    if run % 2 == 0:
        return [{"step": step, "replica": victim, "phase": KILL_PHASES[(3 * k + j) % 4]}
                for j, (step, victim) in enumerate(zip((2, 5, 8), victims, strict=True))]
    return [{"step": 3, "replica": victims[0], "phase": KILL_PHASES[(k + 3) % 4]},
            {"step": 7, "replica": victims[1], "phase": IN_STEP[k % 3]},
            {"step": 7, "replica": victims[2], "phase": SECONDARY[k % 2]}]


def spec(kill: dict[str, Any]) -> str:
    return f"step={kill['step']},replica={kill['replica']},phase={kill['phase']}"


def stats(values: list[float | None]) -> dict[str, Any]:
    """n, missing, p50/p99/max/mean/min in seconds; percentiles interpolate linearly (pure)."""
    known = [v for v in values if v is not None]
    out: dict[str, Any] = {"n": len(known), "missing": len(values) - len(known)}
    if known:
        out.update(p50_s=round(percentile(known, 50), 4), p99_s=round(percentile(known, 99), 4),
                   max_s=round(max(known), 4), mean_s=round(statistics.fmean(known), 4),
                   min_s=round(min(known), 4))
    return out


def split_recoveries(summary: dict[str, Any]) -> list[dict[str, float]]:
    """Per recovery: detect, plan, rebuild, recompute, commit, total seconds (pure).

    Needs summary.json's failures, started_at, committed_at_s_per_step,
    commit_wait_s_per_step and the events `run_recover` collected.
    """
    start = summary["started_at"]
    groups: dict[float, list[tuple[float, float]]] = {}
    for f in summary["failures"]:
        if f["detected_s"] is None or f["recovered_s"] is None or f["at_s"] is None:
            continue
        detected = start + f["at_s"]
        killed = detected - f["detected_s"]
        groups.setdefault(round(killed + f["recovered_s"], 3), []).append((killed, detected))
    generations = sorted(e["at"] for e in summary.get("events", []) if e["kind"] == "generation")
    commits = [start + t for t in summary["committed_at_s_per_step"] if t is not None]
    waits = summary.get("commit_wait_s_per_step", [])
    out = []
    for recovered, members in sorted(groups.items()):
        killed, detected = min(members)
        last_detected = max(d for _, d in members)
        broadcast = max((g for g in generations if last_detected - 0.002 <= g <= recovered),
                        default=None)
        if broadcast is None:
            continue  # the generation event was not polled before the job ended
        after = [i for i, t in enumerate(commits) if t >= recovered]
        row = {"detect": detected - killed, "plan": broadcast - detected,
               "rebuild": recovered - broadcast, "total": recovered - killed,
               "failures": float(len(members))}
        if after:
            row["recompute"] = commits[after[0]] - recovered
            if after[0] < len(waits):
                row["commit"] = waits[after[0]]
        out.append({k: round(max(v, 0.0), 5) for k, v in row.items()})
    return out


def _run_one(index: int, config: RecoveryConfig) -> tuple[dict[str, Any] | None, str]:
    args = ["--replicas", str(config.replicas), "--steps", str(STEPS),
            "-M", str(config.global_microbatches), "-B", "8",
            "--seed", str(index)]
    for kill in schedule(index, config.replicas):
        args += ["--kill", spec(kill)]
    try:
        # Events are kept by the controller, so a slow poll loses none mid-run and
        # spares the job's shared cores (the kills come from --kill, not from here).
        return run_recover(config.out / f"run-{index:02d}", args, label=f"run {index}",
                           timeout_s=config.timeout_s, poll_s=0.25), ""
    except JobFailed as exc:
        return None, str(exc)


def run(config: RecoveryConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    env = environment()
    failures: list[dict[str, Any]] = []
    recoveries: list[dict[str, float]] = []
    runs: list[dict[str, Any]] = []
    anomalies: list[str] = []
    began = time.monotonic()
    for index in range(config.first_run, config.first_run + config.runs):
        started = time.monotonic()
        summary, error = _run_one(index, config)
        kills = schedule(index, config.replicas)
        if summary is None:
            anomalies.append(f"run {index}: {error}")
            failures += [{"run": index, **k, "detected_s": None, "recovered_s": None}
                         for k in kills]
        else:
            got = summary["failures"]
            if len(got) != len(kills):
                anomalies.append(f"run {index}: {len(got)} failures recorded for {len(kills)} kills")
            failures += [{"run": index, **f} for f in got]
            recoveries += [{"run": index, **r} for r in split_recoveries(summary)]
        recovered = [f["recovered_s"] for f in failures if f["run"] == index and f["recovered_s"]]
        runs.append({"run": index, "kills": [spec(k) for k in kills], "ok": summary is not None,
                     "elapsed_s": round(time.monotonic() - started, 2)})
        progress(f"[run {index + 1}/{config.first_run + config.runs}] "
                 f"{'ok' if summary else 'FAILED'} "
                 f"{time.monotonic() - started:.1f}s, recovered in "
                 f"{', '.join(f'{r * 1000:.0f}' for r in recovered) or '-'} ms  "
                 f"load {environment()['loadavg_1m']}  kills: {'; '.join(spec(k) for k in kills)}")
    phases = [p for p in KILL_PHASES + SECONDARY if any(f["phase"] == p for f in failures)]
    overall = stats([f["recovered_s"] for f in failures])
    return {
        "benchmark": "recovery", "environment": env,
        "loadavg_1m_end": environment()["loadavg_1m"],
        "config": {"replicas": config.replicas, "steps": STEPS,
                   "global_microbatches": config.global_microbatches,
                   "microbatch_size": 8, "runs": config.runs, "agents": 2,
                   "timeout_s": config.timeout_s},
        "bench_wall_s": round(time.monotonic() - began, 1),
        "n_failures": len(failures), "n_recoveries": len(recoveries),
        "p50_s": overall.get("p50_s"), "p99_s": overall.get("p99_s"),
        "recovered": {"overall": overall,
                      "by_kill_phase": {p: stats([f["recovered_s"] for f in failures
                                                  if f["phase"] == p]) for p in phases}},
        "detected": {"overall": stats([f["detected_s"] for f in failures]),
                     "by_kill_phase": {p: stats([f["detected_s"] for f in failures
                                                 if f["phase"] == p]) for p in phases}},
        "split": {p: stats([r.get(p) for r in recoveries]) for p in [*SPLIT, "total"]},
        "failed_runs": sum(1 for r in runs if not r["ok"]),
        "anomalies": anomalies, "runs": runs, "failures": failures, "recoveries": recoveries,
    }


def _cells(s: dict[str, Any]) -> str:
    if not s["n"]:
        return f"{'-':>8} {'-':>8} {'-':>8}"
    return f"{s['p50_s'] * 1000:>6.1f}ms {s['p99_s'] * 1000:>6.1f}ms {s['max_s'] * 1000:>6.1f}ms"


def format_table(results: dict[str, Any]) -> str:
    lines = [f"{results['n_failures']} failures, {results['n_recoveries']} recoveries over "
             f"{results['config']['runs']} runs ({results['bench_wall_s']}s), "
             f"{results['config']['replicas']} replicas",
             f"{'by kill phase':<14} {'n':>3}  {'detect p50':>8} {'p99':>8} {'max':>8}   "
             f"{'recover p50':>8} {'p99':>8} {'max':>8}"]
    det, rec = results["detected"], results["recovered"]
    lines.append(f"{'overall':<14} {rec['overall']['n']:>3}  {_cells(det['overall'])}   "
                 f"{_cells(rec['overall'])}")
    for p, s in rec["by_kill_phase"].items():
        lines.append(f"{p:<14} {s['n']:>3}  {_cells(det['by_kill_phase'][p])}   {_cells(s)}")
    lines.append(f"{'recovery phase':<14} {'n':>3}  {'p50':>8} {'p99':>8} {'max':>8}")
    for p, s in results["split"].items():
        lines.append(f"{p:<14} {s['n']:>3}  {_cells(s)}")
    for a in results["anomalies"]:
        lines.append(f"anomaly: {a}")
    return "\n".join(lines)
