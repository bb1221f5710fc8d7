"""Uniform vs throughput-proportional quotas vs work-stealing, side by side (issue 21, "Speed").

Every round runs, for each M (default 16 and 64), nine `recover run --replicas 4 --steps N
-M M -B 2 --compute-ms C` jobs (C ms of emulated accelerator time per microbatch, a sleep,
plus the tiny model's real forward/backward, kept small with -B 2):

  uniform-equal     --policy recover                     (equal replicas)
  prop-equal        --policy proportional
  propsteal-equal   --policy proportional --work-stealing
  uniform-slow      --policy recover       --slowdown replica=2,factor=2
  prop-slow         --policy proportional  --slowdown replica=2,factor=2
  steal-slow        --policy recover       --work-stealing --slowdown replica=2,factor=2
  propsteal-slow    --policy proportional  --work-stealing --slowdown replica=2,factor=2
  prop-midrun       --policy proportional  --slowdown replica=2,factor=2,from_step=S,until_step=T
  propsteal-midrun  the same with --work-stealing

The order of the runs flips every round (A B C ... | ... C B A), so drift and the load of
the shared machine hit every case alike. Step time of a run: the median commit-to-commit
interval (summary.json's `committed_at_s_per_step`) of the steps after the warm-up.

Ideal: M * t / sum_r(1 / f_r), f_r each replica's slowdown factor and t a normal replica's
time per microbatch, taken from the round's uniform-equal run: t = step / (M / 4). So the
ideal is uniform-equal * 4 / 3.5 with one 2x replica (t carries the per-step reduce and
commit, spread over microbatches, which makes the ideal a few ms generous). Integer quotas
cannot reach it: the bound printed next to it is the best integer makespan (M = 16: 5t vs
4.57t; M = 64: 19t vs 18.29t).

Ratios (a / b): ratio of the medians over rounds of each case's step time, with a 95 %
bootstrap interval resampling rounds (a round's runs stay together), and the per-round
ratios' median.

Mid-run slowdown (prop-midrun): from microbatches_by_replica_per_step, the lag after S is
how many steps from S on still give replica 2 the equal-replica share (its quota above
the midpoint between M / 4 and its proportional share M / 7), the lag after T how many from
T on still give it the slowed share; step S and step T are planned before the change, so
1 is the least possible. Extra cost: sum over steps S.. of (interval - the round's
prop-slow step) while slowed and over T.. of (interval - prop-equal step) after, in units
of the prop-equal step (propsteal-midrun: against propsteal-slow and propsteal-equal).
The paper's policy is not measured: its quota rule is not in the text available here.

    .venv/bin/python bench/scripts/quotas.py --rounds 6 --out bench/results/quotas
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from recover.bench.env import environment, foreign_load, percentile

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling script below
import before_after  # noqa: E402

REPLICAS, SLOW, FACTOR = 4, 2, 2.0
CASES = ("uniform-equal", "prop-equal", "propsteal-equal", "uniform-slow", "prop-slow",
         "steal-slow", "propsteal-slow", "prop-midrun", "propsteal-midrun")
SLOW_CASES = ("uniform-slow", "prop-slow", "steal-slow", "propsteal-slow")
BOOTSTRAP = 4000


def case_args(case: str, slow_from: int, slow_until: int) -> list[str]:
    policy = ["--policy", "recover" if case.startswith(("uniform", "steal-")) else "proportional"]
    if "steal" in case:
        policy.append("--work-stealing")
    if case.endswith("slow"):
        return [*policy, "--slowdown", f"replica={SLOW},factor={FACTOR:g}"]
    if case.endswith("midrun"):
        return [*policy, "--slowdown",
                f"replica={SLOW},factor={FACTOR:g},from_step={slow_from},until_step={slow_until}"]
    return policy


def ideal_units(m: int) -> float:
    """Ideal step in units of t: M / sum(1 / f_r)."""
    return m / (REPLICAS - 1 + 1 / FACTOR)


def integer_bound_units(m: int) -> float:
    """Best makespan with integer quotas, in units of t: the least T with sum_r floor(T / f_r) >= M."""
    factors = [FACTOR if r == SLOW else 1.0 for r in range(REPLICAS)]
    candidates = sorted({k * f for f in factors for k in range(1, m + 1)})
    return next(c for c in candidates if sum(math.floor(c / f + 1e-9) for f in factors) >= m)


# ------------------------------------------------------------------ one run

def run_job(out: Path, args: list[str], timeout_s: float) -> dict[str, Any]:
    """`recover run ... --out OUT` of this checkout, stopped (its whole session) after
    timeout_s; its summary (before_after.py's runner, with this python's build)."""
    return before_after.run_job([sys.executable, "-m", "recover.cli.main"], out, args, timeout_s)


def one_run(out: Path, args: list[str], warmup: int, timeout_s: float) -> dict[str, Any]:
    load = round(os.getloadavg()[0], 2)
    s = run_job(out, args, timeout_s)
    at = s["committed_at_s_per_step"]
    dt = [at[0]] + [at[t] - at[t - 1] for t in range(1, len(at))]
    loads = [{int(r): n for r, n in step.items()} for step in s["microbatches_by_replica_per_step"]]
    return {"args": args, "load_1m_before": load, "wall_s": s["wall_s"],
            "steps_committed": s["steps_committed"], "failures": len(s["failures"]),
            "step_s": round(statistics.median(dt[warmup:]), 5),
            "step_intervals_s": [round(x, 5) for x in dt],
            "microbatches_by_replica_per_step": [[q.get(r, 0) for r in range(REPLICAS)]
                                                 for q in loads],
            "stolen_per_step": s.get("stolen_per_step", []),
            "param_sha256": s["param_sha256"]}


# ------------------------------------------------------------------ statistics

def ratio_stats(pairs: list[tuple[float, float]], seed: int = 0) -> dict[str, Any]:
    """a / b over rounds: ratio of the medians, 95 % bootstrap interval over rounds."""
    if not pairs:
        return {"n_rounds": 0}

    def ratio(sample: list[tuple[float, float]]) -> float:
        return statistics.median(a for a, _ in sample) / statistics.median(b for _, b in sample)

    rng = random.Random(seed)
    boot = sorted(ratio([rng.choice(pairs) for _ in pairs]) for _ in range(BOOTSTRAP))
    return {"n_rounds": len(pairs), "ratio": round(ratio(pairs), 4),
            "ci95": [round(percentile(boot, 2.5), 4), round(percentile(boot, 97.5), 4)],
            "per_round_median": round(statistics.median(a / b for a, b in pairs), 4)}


def median_ci(values: list[float], seed: int = 0) -> dict[str, Any]:
    """Median with a 95 % bootstrap interval."""
    if not values:
        return {"n": 0}
    rng = random.Random(seed)
    boot = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(BOOTSTRAP))
    return {"n": len(values), "median": round(statistics.median(values), 4),
            "ci95": [round(percentile(boot, 2.5), 4), round(percentile(boot, 97.5), 4)],
            "values": [round(v, 4) for v in values]}


def adaptation(run: dict[str, Any], m: int, s: int, t: int, ref_slow: float,
               ref_equal: float) -> dict[str, Any]:
    """Lag (steps) of the plan after the slowdown starts (S) and ends (T), and the extra time."""
    quotas = [q[SLOW] for q in run["microbatches_by_replica_per_step"]]
    mid = (m / REPLICAS + m / FACTOR * 1 / (REPLICAS - 1 + 1 / FACTOR)) / 2
    dt = run["step_intervals_s"]
    on = next((k - s for k in range(s, t) if quotas[k] < mid), None)
    off = next((k - t for k in range(t, len(quotas)) if quotas[k] > mid), None)
    extra_on = sum(dt[k] - ref_slow for k in range(s, t)) / ref_equal
    extra_off = sum(dt[k] - ref_equal for k in range(t, len(dt))) / ref_equal
    return {"slowed_quota_per_step": quotas, "lag_after_from_step": on,
            "lag_after_until_step": off, "extra_steps_slowed": round(extra_on, 3),
            "extra_steps_after": round(extra_off, 3), "extra_steps": round(extra_on + extra_off, 3)}


def analyse(result: dict[str, Any]) -> None:
    """Figures and verdicts from the raw rounds (in place)."""
    job, rounds = result["job"], result["rounds"]
    s, t = job["slow_from"], job["slow_until"]
    figures: dict[str, Any] = {}
    for m in job["microbatches"]:
        key = str(m)

        def step(rnd: dict[str, Any], case: str, key: str = key) -> float:
            return float(rnd["runs"][key][case]["step_s"])

        per: dict[str, Any] = {}
        have = [r for r in rounds if all(c in r["runs"][key] for c in CASES)]
        scale = REPLICAS / (REPLICAS - 1 + 1 / FACTOR)  # ideal = uniform-equal * scale
        per["step_s"] = {c: median_ci([step(r, c) for r in have]) for c in CASES}
        per["t_ms"] = median_ci([step(r, "uniform-equal") / (m / REPLICAS) * 1000 for r in have])
        per["ideal_units_t"] = round(ideal_units(m), 4)
        per["integer_bound_over_ideal"] = round(integer_bound_units(m) / ideal_units(m), 4)
        per["over_ideal"] = {c: ratio_stats([(step(r, c), step(r, "uniform-equal") * scale)
                                             for r in have])
                             for c in SLOW_CASES}
        per["uniform_slow_over_prop_slow"] = ratio_stats(
            [(step(r, "uniform-slow"), step(r, "prop-slow")) for r in have])
        per["uniform_slow_over_propsteal_slow"] = ratio_stats(
            [(step(r, "uniform-slow"), step(r, "propsteal-slow")) for r in have])
        per["prop_equal_over_uniform_equal"] = ratio_stats(
            [(step(r, "prop-equal"), step(r, "uniform-equal")) for r in have])
        per["propsteal_equal_over_uniform_equal"] = ratio_stats(
            [(step(r, "propsteal-equal"), step(r, "uniform-equal")) for r in have])
        per["prop_equal_nonuniform_plan_steps"] = [
            sum(1 for q in r["runs"][key]["prop-equal"]["microbatches_by_replica_per_step"]
                if max(q) - min(q) > 1) for r in have]
        for name, prefix in (("midrun", "prop"), ("midrun_steal", "propsteal")):
            mids = [adaptation(r["runs"][key][f"{prefix}-midrun"], m, s, t,
                               step(r, f"{prefix}-slow"), step(r, f"{prefix}-equal"))
                    for r in have]
            per[name] = {
                "per_round": mids,
                "lag_after_from_step": [x["lag_after_from_step"] for x in mids],
                "lag_after_until_step": [x["lag_after_until_step"] for x in mids],
                **{k: median_ci([x[k] for x in mids])
                   for k in ("extra_steps_slowed", "extra_steps_after", "extra_steps")}}
        figures[key] = per
    result["figures"] = figures
    result["checks"] = {
        "all_steps_committed": all(run["steps_committed"] == run_steps(job, c)
                                   for r in rounds for key in r["runs"]
                                   for c, run in r["runs"][key].items()),
        "failures": sum(run["failures"] for r in rounds for key in r["runs"]
                        for run in r["runs"][key].values())}
    result["verdicts"] = verdicts(figures)


def run_steps(job: dict[str, Any], case: str) -> int:
    return int(job["midrun_steps"] if case.endswith("midrun") else job["steps"])


def verdicts(figures: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, per in figures.items():
        speed = per["uniform_slow_over_prop_slow"]
        ideal = per["over_ideal"]["prop-slow"]
        eq = per["prop_equal_over_uniform_equal"]
        if not speed.get("n_rounds"):
            continue
        lo, hi = eq["ci95"]
        lags = per["midrun"]["lag_after_from_step"] + per["midrun"]["lag_after_until_step"]
        steal_speed = per["uniform_slow_over_propsteal_slow"]
        steal_ideal = per["over_ideal"]["propsteal-slow"]
        steal_eq = per["propsteal_equal_over_uniform_equal"]
        steal_mid = per["midrun_steal"]["extra_steps"]
        out[key] = {
            "proportional + stealing >= 1.5x faster than uniform (one 2x replica)":
                "met" if steal_speed["ci95"][0] >= 1.5 else "not met"
                if steal_speed["ci95"][1] < 1.5 else "not resolved",
            "proportional + stealing within 5 % of ideal":
                "met" if steal_ideal["ci95"][1] <= 1.05 else "not met"
                if steal_ideal["ci95"][0] > 1.05 else "not resolved",
            "equal replicas: proportional + stealing within 1 % of uniform":
                "met" if steal_eq["ci95"][0] >= 0.99 and steal_eq["ci95"][1] <= 1.01
                else "no slowdown beyond 1 %" if steal_eq["ci95"][1] <= 1.01
                else "slower" if steal_eq["ci95"][0] > 1.01 else "not resolved",
            "mid-run slowdown with stealing: extra cost <= 1 step":
                "met" if steal_mid["ci95"][1] <= 1 else "not met" if steal_mid["ci95"][0] > 1
                else "not resolved",
            "proportional >= 1.5x faster than uniform (one 2x replica)":
                "met" if speed["ci95"][0] >= 1.5 else "not met" if speed["ci95"][1] < 1.5
                else "not resolved",
            "proportional (no stealing) within 5 % of ideal":
                "met" if ideal["ci95"][1] <= 1.05 else "not met" if ideal["ci95"][0] > 1.05
                else "not resolved",
            "equal replicas: proportional within 1 % of uniform":
                "met" if lo >= 0.99 and hi <= 1.01 else "no slowdown beyond 1 %" if hi <= 1.01
                else "slower" if lo > 1.01 else "not resolved",
            "mid-run slowdown: plan adapts within 1 step (both ways)":
                "met" if lags and all(x is not None and x <= 1 for x in lags) else "not met",
            "mid-run slowdown: extra cost <= 1 step":
                "met" if per["midrun"]["extra_steps"]["ci95"][1] <= 1 else "not met"
                if per["midrun"]["extra_steps"]["ci95"][0] > 1 else "not resolved"}
    return out


# ------------------------------------------------------------------ report

def fmt(r: dict[str, Any]) -> str:
    return f"**{r['ratio']:.3f}** ({r['ci95'][0]:.3f}-{r['ci95'][1]:.3f})"


def table(result: dict[str, Any]) -> str:
    """The markdown tables of BENCHMARKS.md."""
    lines = ["| M | t (normal replica, per microbatch) | uniform-slow / ideal | prop-slow / ideal "
             "(integer bound) | uniform-slow / prop-slow | prop-equal / uniform-equal | "
             "mid-run: lag after S, after T (steps, per round) | mid-run extra cost (steps) |",
             "|---|---|---|---|---|---|---|---|"]
    for key, per in result["figures"].items():
        mid = per["midrun"]
        ex = mid["extra_steps"]
        lines.append(
            f"| {key} | {per['t_ms']['median']:.1f} ms | {fmt(per['over_ideal']['uniform-slow'])} | "
            f"{fmt(per['over_ideal']['prop-slow'])} ({per['integer_bound_over_ideal']:.3f}) | "
            f"{fmt(per['uniform_slow_over_prop_slow'])} | "
            f"{fmt(per['prop_equal_over_uniform_equal'])} | "
            f"{mid['lag_after_from_step']}, {mid['lag_after_until_step']} | "
            f"**{ex['median']:.2f}** ({ex['ci95'][0]:.2f}-{ex['ci95'][1]:.2f}) |")
    lines += ["", "| M | uniform-slow / ideal | steal-slow / ideal | propsteal-slow / ideal | "
              "uniform-slow / propsteal-slow | propsteal-equal / uniform-equal | "
              "mid-run extra cost with stealing (steps) | microbatches stolen per step "
              "(propsteal-slow, median) |", "|---" * 8 + "|"]
    for key, per in result["figures"].items():
        ex = per["midrun_steal"]["extra_steps"]
        stolen = [statistics.median(r["runs"][key]["propsteal-slow"]["stolen_per_step"] or [0])
                  for r in result["rounds"] if "propsteal-slow" in r["runs"][key]]
        lines.append(
            f"| {key} | {fmt(per['over_ideal']['uniform-slow'])} | "
            f"{fmt(per['over_ideal']['steal-slow'])} | {fmt(per['over_ideal']['propsteal-slow'])} | "
            f"{fmt(per['uniform_slow_over_propsteal_slow'])} | "
            f"{fmt(per['propsteal_equal_over_uniform_equal'])} | "
            f"**{ex['median']:.2f}** ({ex['ci95'][0]:.2f}-{ex['ci95'][1]:.2f}) | "
            f"{statistics.median(stolen) if stolen else '-'} |")
    lines += ["", "| M | " + " | ".join(CASES) + " |", "|---" * (len(CASES) + 1) + "|"]
    for key, per in result["figures"].items():
        lines.append(f"| {key} | " + " | ".join(
            f"{per['step_s'][c]['median'] * 1000:.1f} ms" for c in CASES) + " |")
    return "\n".join(lines) + "\n"


def measure(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    common = ["--replicas", str(REPLICAS), "-B", str(args.microbatch_size),
              "--compute-ms", str(args.compute_ms), "--seed", "0"]
    plan = [(m, c) for m in args.microbatches for c in CASES]
    env_before = {**environment(), **foreign_load()}
    began = time.monotonic()
    rounds: list[dict[str, Any]] = []
    for i in range(args.rounds):
        order = plan if i % 2 == 0 else list(reversed(plan))
        rnd: dict[str, Any] = {"round": i, "order": [f"{m}/{c}" for m, c in order],
                               "runs": {str(m): {} for m in args.microbatches}}
        for m, case in order:
            steps = args.midrun_steps if case.endswith("midrun") else args.steps
            run_args = [*common, "-M", str(m), "--steps", str(steps),
                        *case_args(case, args.slow_from, args.slow_until)]
            run_dir = out / "runs" / f"{i:02d}-{m}-{case}"
            rnd["runs"][str(m)][case] = one_run(run_dir, run_args, args.warmup, args.timeout)
            if not args.keep_runs:
                shutil.rmtree(run_dir)
        rounds.append(rnd)
        print(f"round {i + 1}/{args.rounds} ({time.monotonic() - began:.0f}s, load "
              f"{os.getloadavg()[0]:.2f}): " + "; ".join(
                  f"M={m} " + " ".join(f"{c} {rnd['runs'][m][c]['step_s'] * 1000:.0f}"
                                       for c in CASES)
                  for m in rnd["runs"]), file=sys.stderr, flush=True)
        # Kept after every round: an interrupted measurement can still be --reanalyse'd.
        (out / "results.json").write_text(json.dumps(document(args, common, rounds, began,
                                                              env_before), indent=2) + "\n")
    if not args.keep_runs:
        shutil.rmtree(out / "runs", ignore_errors=True)
    return document(args, common, rounds, began, env_before)


def document(args: argparse.Namespace, common: list[str], rounds: list[dict[str, Any]],
             began: float, env_before: dict[str, Any]) -> dict[str, Any]:
    return {"benchmark": "quotas", "issue": 21, "command": [sys.executable, *sys.argv],
            "job": {"common_args": common, "microbatches": args.microbatches,
                    "steps": args.steps, "midrun_steps": args.midrun_steps, "warmup": args.warmup,
                    "slow_from": args.slow_from, "slow_until": args.slow_until,
                    "cases": {c: case_args(c, args.slow_from, args.slow_until) for c in CASES}},
            "not_measured": "--policy paper (issue 21 item 4): its quota rule is not in the "
                            "text available here",
            "bench_wall_s": round(time.monotonic() - began, 1), "environment_before": env_before,
            "environment": {**environment(), **foreign_load()}, "rounds": rounds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="results.json and table.md go here")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("-M", "--microbatches", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--compute-ms", type=float, default=45.0)
    parser.add_argument("-B", "--microbatch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="steps of the steady runs")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the step time")
    parser.add_argument("--slow-from", type=int, default=5, help="S of prop-midrun")
    parser.add_argument("--slow-until", type=int, default=11, help="T of prop-midrun")
    parser.add_argument("--midrun-steps", type=int, default=16, help="steps of prop-midrun")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run")
    parser.add_argument("--keep-runs", action="store_true", help="keep each run's folder")
    parser.add_argument("--reanalyse", action="store_true",
                        help="run nothing: recompute the figures of OUT/results.json")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    if args.reanalyse:
        result = json.loads((out / "results.json").read_text())
    else:
        if not args.warmup < args.steps or not (
                args.warmup <= args.slow_from < args.slow_until < args.midrun_steps):
            parser.error("need warmup < steps and warmup <= slow-from < slow-until < midrun-steps")
        out.mkdir(parents=True, exist_ok=True)
        result = measure(args, out)
    analyse(result)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "table.md").write_text(table(result))
    print(table(result))
    print(json.dumps({"verdicts": result["verdicts"], "checks": result["checks"]}, indent=2))
    print(f"results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
