"""Capacity comes back: rejoin latency and its split, spare promotion, and the stall a join costs.

Real `recover run` jobs (controller, 2 agents, 4 workers, exact reduction,
`--compute-ms 30` of emulated accelerator time per microbatch), three kinds,
interleaved so that load drifts hit all of them:

* `kill`: replica 1 SIGKILLed mid-backward at step K; its agent restarts the
  slot as a fresh replica, which joins with live state transfer;
* `spare`: the same with `--spares 1`: the warm spare is promoted, the
  restarted worker then joins as the next spare;
* `ref`: failure-free, 4 replicas (the step time a join should not disturb,
  and the parameters every other run of its seed must match bitwise);
* `kill-cold` (with `--cold-too`): each `kill` run again right after it, with
  `--cold-start`, so the warm restart (workers forked from the agent's warm
  interpreter) and the cold one (a fresh process importing torch) are compared side by side.

Latencies come from the controller's events (OUT/logs/controller.log), step
times from summary.json's `committed_at_s_per_step`. The events do not split
restart -> ready (interpreter start, imports, model build, the determinism
check); `--import-probes` fresh interpreters timed importing the workload
(`python -c "import recover.workloads.tinygpt.__main__"`) between runs give the import
share. On this machine the joiner shares the 2 cores with the survivors, so
the 3-replica steps before the join already pay for its process start.

    python bench/scripts/rejoin.py --out bench/results/rejoin     # ~7-9 min
    python bench/scripts/rejoin.py --runs 6 --spare-runs 0 --refs 2 --cold-too --out bench/results/rejoin-warm
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from recover.bench.env import environment

sys.path.insert(0, str(Path(__file__).resolve().parent))
from joblog import Event, enters_at, events, first, median_or_none, run_job, spread, step_times  # noqa: E402

JOB = ["--reduce", "exact", "--replicas", "4", "-M", "12", "-B", "4", "--compute-ms", "30"]
KILL_STEPS = [20, 30, 40, 25, 35]
SPARE_KILL_STEPS = [40, 30, 50]
STALL_TARGET = 1.10


def schedule(runs: int, spare_runs: int, refs: int,
             cold_too: bool = False) -> list[tuple[str, int, int | None]]:
    """(kind, seed, kill step), interleaved: refs spread out, a spare run after each kill run
    (and its cold twin right after it with `cold_too`)."""
    plan: list[tuple[str, int, int | None]] = []
    ref_at = {round(i * max(runs, spare_runs) / max(refs, 1)) for i in range(refs)}
    for i in range(max(runs, spare_runs)):
        if i in ref_at:
            plan.append(("ref", 1 + sum(p[0] == "ref" for p in plan) % 2, None))
        if i < runs:
            plan.append(("kill", 1 + i % 2, KILL_STEPS[i % len(KILL_STEPS)]))
            if cold_too:
                plan.append(("kill-cold", 1 + i % 2, KILL_STEPS[i % len(KILL_STEPS)]))
        if i < spare_runs:
            plan.append(("spare", 2 - i % 2, SPARE_KILL_STEPS[i % len(SPARE_KILL_STEPS)]))
    return plan


def window(at: list[float], start_rel: float, last: int) -> list[int]:
    """Steps up to `last` whose interval (previous commit -> commit) ends after `start_rel`."""
    return [t for t in range(1, last + 1) if at[t] > start_rel]


def stall(dt: list[float], steps: list[int], base: float | None) -> dict[str, Any]:
    """Step times of `steps` against a baseline median: the worst step and the median."""
    times = [dt[t] for t in steps]
    if not times or not base:
        return {"steps": steps, "worst_ratio": None, "median_ratio": None}
    return {"steps": steps, "step_s": [round(x, 4) for x in times],
            "worst_ratio": round(max(times) / base, 3),
            "median_ratio": round(statistics.median(times) / base, 3)}


def rounded(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def since(later: Event | None, earlier: Event | float | None) -> float | None:
    """Seconds between two events (or an event and a unix time), None if either is missing."""
    if later is None or earlier is None:
        return None
    return round(later.ts - (earlier.ts if isinstance(earlier, Event) else earlier), 3)


def analyse(summary: dict[str, Any], evs: list[Event], kind: str, kill: int | None) -> dict[str, Any]:
    at, dt = summary["committed_at_s_per_step"], step_times(summary)
    reps, t0 = summary["replicas_per_step"], summary["started_at"]
    m = summary["global_microbatches"]
    res: dict[str, Any] = {
        "steps_committed": summary["steps_committed"],
        "steps_short_of_m": sum(1 for x in summary["microbatches_per_step"] if x != m),
        # Steady 4-replica step time before any failure (the first 3 steps warm up).
        "median4_s": rounded(median_or_none(
            [dt[t] for t in range(3, kill or len(at)) if reps[t] == 4]), 4),
    }
    if kill is None:
        return res
    failure = summary["failures"][0]
    # summary.json's at_s is the detection (relative to started_at); detected_s is kill -> it.
    kill_ts = t0 + failure["at_s"] - (failure["detected_s"] or 0.0)
    res["detect_s"] = failure["detected_s"]
    restarted = first(evs, "replica-restarted", after=kill_ts)
    joiner = restarted.replica if restarted else -1
    ready = first(evs, "replica-ready", replica=joiner)
    js = first(evs, "join-started", replica=joiner)
    xfer = first(evs, "state-transfer", replica=joiner)
    res["joiner"] = joiner
    res["kill_to_restart_s"] = since(restarted, kill_ts)
    res["restart_to_ready_s"] = since(ready, restarted)
    res["ready_to_join_started_s"] = since(js, ready)
    res["join_attempts"] = sum(1 for e in evs if e.kind == "join-started" and e.replica == joiner)
    if xfer is not None:
        found = re.search(r"(\d+) bytes from replica \d+ in ([\d.]+)s \((\d+) MB/s\)", xfer.message)
        if found:
            nbytes, secs, rate = int(found[1]), float(found[2]), int(found[3])
            # The message rounds seconds to 1 ms; bytes / rate keeps 2-3 significant digits.
            res["transfer_bytes"] = nbytes
            res["transfer_s"] = round(nbytes / (rate * 1e6), 5) if rate else secs
        res["join_started_to_transfer_reported_s"] = since(xfer, js)
    if kind in ("kill", "kill-cold"):
        joined = first(evs, "replica-joined", replica=joiner)
        res["transfer_end_to_joined_s"] = since(joined, xfer)
        res["kill_to_joined_s"] = since(joined, kill_ts)
        if js is None or joined is None:
            return res
        entry = res["entry_step"] = enters_at(joined)
        win = window(at, js.ts - t0, entry) or [entry]
        # 3-replica steps with no join going on: skip the recovery step and the one after.
        calm3 = [dt[t] for t in range(kill + 2, win[0]) if reps[t] == 3]
        base3 = median_or_none(calm3)
        res["median3_s"], res["calm3_steps"] = rounded(base3, 4), len(calm3)
        res["join_window"] = stall(dt, win, base3)
        if not calm3:
            return res
        # How often an ordinary 3-replica step exceeds the target anyway: the noise floor.
        res["calm3_over_target"] = round(sum(x > STALL_TARGET * base3 for x in calm3) / len(calm3),
                                         3) if base3 else None
        res["entry_vs_median4"] = stall(dt, [entry], res["median4_s"])["worst_ratio"]
        return res
    promoted = first(evs, "spare-promoted", after=kill_ts)
    if promoted is None:
        return res
    entry = enters_at(promoted)
    res["kill_to_promoted_s"] = since(promoted, kill_ts)
    res["promoted_entry_step"], res["promoted_steps_after_kill"] = entry, entry - kill
    res["kill_step_vs_median4"] = stall(dt, [kill], res["median4_s"])["worst_ratio"]
    res["promotion"] = stall(dt, list(range(kill + 1, entry + 1)), res["median4_s"])
    if js is not None and xfer is not None:
        # The restarted worker joins as the next spare while 4 members train: the steps from
        # join-started to the one after the snapshot arrived, vs calm 4-replica steps before.
        end = next((t for t in range(len(at)) if at[t] > xfer.ts - t0), len(at) - 1)
        win = window(at, js.ts - t0, min(end + 1, len(at) - 1)) or [len(at) - 1]
        calm4 = [dt[t] for t in range(entry + 2, win[0]) if reps[t] == 4]
        res["spare_join_window"] = stall(dt, win, median_or_none(calm4))
    return res


def import_probe() -> float:
    """Seconds for a fresh interpreter to import the reference workload (torch included)."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import recover.workloads.tinygpt.__main__"], check=True)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", type=int, default=5, help="kill-and-rejoin runs")
    parser.add_argument("--spare-runs", type=int, default=3, help="--spares 1 runs")
    parser.add_argument("--refs", type=int, default=2, help="failure-free runs")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--import-probes", type=int, default=1, help="after each run")
    parser.add_argument("--keep-runs", action="store_true", help="keep each run's folder")
    parser.add_argument("--cold-too", action="store_true",
                        help="repeat each kill run with --cold-start, side by side")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env_before = environment()
    runs: list[dict[str, Any]] = []
    probes: list[float] = []
    for i, (kind, seed, kill) in enumerate(schedule(args.runs, args.spare_runs, args.refs,
                                                    args.cold_too)):
        job = [*JOB, "--steps", str(args.steps), "--seed", str(seed)]
        if kind == "spare":
            job += ["--spares", "1"]
        if kind == "kill-cold":
            job += ["--cold-start"]
        if kill is not None:
            job += ["--kill", f"step={kill},replica=1,phase=backward"]
        run_dir = out / f"run-{i:02d}-{kind}"
        started, load = time.time(), round(os.getloadavg()[0], 2)
        summary = run_job(run_dir, job)
        res = analyse(summary, events(run_dir), kind, kill)
        runs.append({"run": i, "kind": kind, "seed": seed, "kill_step": kill, "args": job,
                     "wall_s": round(time.time() - started, 1), "load_1m_before": load,
                     "param_sha256_per_step": summary["param_sha256_per_step"], **res})
        if not args.keep_runs:  # results.json keeps what was measured
            shutil.rmtree(run_dir)
        probes += [import_probe() for _ in range(args.import_probes)]
        print(f"run {i:2d} {kind:5} seed {seed} kill {kill}: " + ", ".join(
            f"{k}={v}" for k, v in res.items() if k.endswith("_s") or k.endswith("ratio")
            or k in ("join_window", "promotion")), file=sys.stderr, flush=True)
    refs = {r["seed"]: r["param_sha256_per_step"] for r in runs if r["kind"] == "ref"}
    for r in runs:
        digests = r.pop("param_sha256_per_step")
        r["bitwise_equal_to_ref"] = digests == refs[r["seed"]] if r["seed"] in refs else None
    by = {k: [r for r in runs if r["kind"] == k] for k in ("kill", "kill-cold", "spare", "ref")}

    def col(kind: str, key: str, sub: str | None = None) -> dict[str, Any]:
        vals = [(r.get(key) or {}).get(sub) if sub else r.get(key) for r in by[kind]]
        return spread([v for v in vals if v is not None])

    kill_keys = ("detect_s", "kill_to_restart_s", "restart_to_ready_s", "ready_to_join_started_s",
                 "join_started_to_transfer_reported_s", "transfer_s", "transfer_bytes",
                 "transfer_end_to_joined_s", "kill_to_joined_s", "median3_s", "median4_s",
                 "entry_vs_median4", "calm3_over_target")
    agg = {"kill-cold": {k: col("kill-cold", k) for k in kill_keys},
           "kill": {k: col("kill", k) for k in (
        "detect_s", "kill_to_restart_s", "restart_to_ready_s", "ready_to_join_started_s",
        "join_started_to_transfer_reported_s", "transfer_s", "transfer_bytes",
        "transfer_end_to_joined_s", "kill_to_joined_s", "median3_s", "median4_s",
        "entry_vs_median4", "calm3_over_target")} | {
        "join_window_worst_ratio": col("kill", "join_window", "worst_ratio"),
        "join_window_median_ratio": col("kill", "join_window", "median_ratio")},
        "spare": {k: col("spare", k) for k in (
            "kill_to_promoted_s", "promoted_steps_after_kill", "median4_s", "kill_step_vs_median4",
            "restart_to_ready_s", "transfer_s", "transfer_bytes")} | {
            "promotion_worst_vs_median4": col("spare", "promotion", "worst_ratio"),
            "spare_join_worst_ratio": col("spare", "spare_join_window", "worst_ratio"),
            "spare_join_median_ratio": col("spare", "spare_join_window", "median_ratio")},
        "ref": {"median4_s": col("ref", "median4_s")},
        "steps_short_of_m_total": sum(r["steps_short_of_m"] for r in runs),
        "all_steps_committed": all(r["steps_committed"] == args.steps for r in runs),
        "runs_compared_to_ref": sum(r["bitwise_equal_to_ref"] is not None for r in runs),
        "all_bitwise_equal_to_ref": all(r["bitwise_equal_to_ref"] is not False for r in runs),
        "import_probe_s": spread(probes, 3)}
    warm_s, cold_s = (agg[k]["kill_to_joined_s"]["median"] for k in ("kill", "kill-cold"))
    agg["kill_to_joined_cold_over_warm"] = round(cold_s / warm_s, 2) if warm_s and cold_s else None
    worst = agg["kill"]["join_window_worst_ratio"]["max"]
    agg["target_worst_step_le_1_10_met"] = worst is not None and worst <= STALL_TARGET
    result = {"benchmark": "rejoin", "job_args": JOB, "steps": args.steps, "runs": runs,
              "aggregate": agg, "environment_before": env_before, "environment": environment(),
              "finished_at": time.time()}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print("\n| quantity (kill runs) | median | min | max | n |\n|---|---|---|---|---|")
    for name, s in agg["kill"].items():
        print(f"| {name} | {s['median']} | {s['min']} | {s['max']} | {s['n']} |")
    for name, s in agg["kill-cold"].items() if by["kill-cold"] else ():
        print(f"| cold: {name} | {s['median']} | {s['min']} | {s['max']} | {s['n']} |")
    if agg["kill_to_joined_cold_over_warm"] is not None:
        print(f"kill -> joined, cold / warm (medians): {agg['kill_to_joined_cold_over_warm']}x")
    for name, s in [*agg["spare"].items(), ("ref median4_s", agg["ref"]["median4_s"])]:
        print(f"| spare/ref: {name} | {s['median']} | {s['min']} | {s['max']} | {s['n']} |")
    print(f"steps short of M: {agg['steps_short_of_m_total']}; all committed: "
          f"{agg['all_steps_committed']}; bitwise equal to ref: {agg['all_bitwise_equal_to_ref']}; "
          f"worst join step <= {STALL_TARGET}: {agg['target_worst_step_le_1_10_met']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
