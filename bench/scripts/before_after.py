"""Two builds side by side (issue 19): failure-free step time and recovery latency, after / before.

Given two ReCoVer builds (a `recover` executable or the python of a venv that
has ReCoVer installed), labelled before and after, it runs the same `recover
run` job with each, interleaved: every round runs the failure-free job with
both builds, then the job with kills with both, and the order of the builds
flips every round (B A B A | A B A B ...), so that drift and the machine's load
hit both alike. Per round both builds use the same seed, and every run is
exact reduction (`--reduce exact`), so the trajectory is checked too.

(a) failure-free: `run --replicas 4 --steps 40 -M 16 --compute-ms 50 --reduce exact`
    (the demo model's default sizes). Figure: the median commit-to-commit interval
    of the steps after the warm-up (steps WARMUP.., from summary.json's
    `committed_at_s_per_step`), one per run.
(b) with kills: the same job with `--kill step=10,replica=1,phase=forward
    --kill step=20,replica=2,phase=reduce --kill step=30,replica=3,phase=commit`
    (restarts as the defaults are: the killed slot's worker comes back and rejoins).
    Figures per failure, as `recover bench recovery` defines them:
    `failures[].recovered_s` (kill -> every survivor computes again) and
    `detected_s` (kill -> the controller knows); the controller's split of each
    recovery (`recovery_phases_s`: detect, plan, rebuild, recompute, commit); and
    the failed step's time, the commit-to-commit interval of the first step
    committed after the recovery (the step whose lost microbatches were recomputed).

Spread: per build the median, quartiles and range; per ratio (after / before,
ratio of the medians) a 95 % bootstrap interval that resamples rounds (pairs kept
together), and the median of the per-round ratios. Verdict against the 1 % target:
"met" when the whole interval lies within [0.99, 1.01], "slower"/"faster" when it
lies wholly beyond, "no slowdown beyond 1 %" when only its upper end is within,
otherwise "not resolved" (the noise is wider than 1 %). Failure figures count the
injected kills only; a failure the job had on its own is listed under `anomalies`.
Digests: every run's final `param_sha256` (and every step's) must equal that of the
round's failure-free run of the same build, and the two builds must agree.
`--reanalyse` recomputes the figures of an existing OUT/results.json from its raw rounds.

    .venv/bin/python bench/scripts/before_after.py \
        --before /tmp/recover-before/.venv/bin/recover --after .venv/bin/recover \
        --rounds 8 --out bench/results/before-after
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from recover.bench.env import environment, foreign_load, percentile

BUILDS = ("before", "after")
KINDS = ("failure_free", "kills")
JOB = ["--replicas", "4", "-M", "16", "--compute-ms", "50", "--reduce", "exact"]
KILLS = ((10, 1, "forward"), (20, 2, "reduce"), (30, 3, "commit"))
SPLIT = ("detect", "plan", "rebuild", "recompute", "commit")
KEYS = ("step_s", "recovered_s", "detected_s", "failed_step_s", *SPLIT)
TARGET = 0.01
BOOTSTRAP = 4000


# ------------------------------------------------------------------ the builds

def build_command(path: str) -> list[str]:
    """The argv prefix that runs `recover` of this build (an executable, or a python)."""
    exe = Path(os.path.abspath(Path(path).expanduser()))  # not resolve(): a venv's python is a link
    if not exe.exists():
        raise SystemExit(f"no such file: {path}")
    if exe.name.startswith("python"):
        return [str(exe), "-m", "recover.cli.main"]
    return [str(exe)]


def build_python(prefix: list[str]) -> str:
    """The interpreter a build runs in (a `recover` script's shebang)."""
    if len(prefix) > 1:
        return prefix[0]
    first = Path(prefix[0]).read_bytes()[:512].split(b"\n", 1)[0].decode()
    if not first.startswith("#!"):
        raise SystemExit(f"{prefix[0]}: not a python script (no #! line); pass its python")
    return first[2:].strip().split()[0]


def describe(label: str, prefix: list[str]) -> dict[str, Any]:
    """Where a build's code lives, its git revision (+dirty), its python and torch."""
    python = build_python(prefix)
    probe = subprocess.run(
        [python, "-c", "import json, os, platform, torch, recover.cli.main as m; print(json.dumps("
         "{'package_dir': os.path.dirname(os.path.dirname(m.__file__)),"
         " 'python': platform.python_version(), 'torch': torch.__version__}))"],
        capture_output=True, text=True, timeout=120, cwd="/")
    if probe.returncode != 0:
        raise SystemExit(f"{label}: cannot import recover with {python}: {probe.stderr[-500:]}")
    info: dict[str, Any] = {"command": prefix, "interpreter": python, **json.loads(probe.stdout)}

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=info["package_dir"], capture_output=True,
                              text=True, timeout=30).stdout

    head = git("rev-parse", "--short", "HEAD").strip()
    dirty = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    info["revision"] = (head + ("+dirty" if dirty else "")) or None
    info["dirty_files"] = dirty
    return info


# ------------------------------------------------------------------ one run

def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_job(prefix: list[str], out: Path, args: list[str], timeout_s: float) -> dict[str, Any]:
    """One `recover run` to its end; its summary.json (raises when it fails or hangs)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cmd = [*prefix, "run", "--quiet", "--out", str(out), *args]
    with open(out / "launcher.log", "wb") as log:
        # cwd outside both checkouts: neither build's source tree shadows the other's package.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=out, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # the launcher ends its controller, agents, workers
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the session this script started
                proc.wait()
            raise RuntimeError(f"no result within {timeout_s:.0f}s: {' '.join(cmd)}") from None
    if rc != 0:
        tail = (out / "launcher.log").read_text(errors="replace")[-1500:]
        raise RuntimeError(f"rc {rc}: {' '.join(cmd)}\n{tail}")
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def step_intervals(summary: dict[str, Any]) -> list[float]:
    """Seconds from the previous step's commit to each step's commit (step 0: from the start)."""
    at = summary["committed_at_s_per_step"]
    return [at[0]] + [at[t] - at[t - 1] for t in range(1, len(at))]


def failed_steps(summary: dict[str, Any], intervals: list[float]) -> list[dict[str, Any]]:
    """Per failure: its latencies, and the step that committed first after the recovery."""
    commits = summary["committed_at_s_per_step"]
    rows = []
    for f in summary["failures"]:
        row = {k: f.get(k) for k in ("step", "replica", "phase", "cause", "detected_s",
                                     "recovered_s", "at_s")}
        if f["at_s"] is not None and f["recovered_s"] is not None:
            killed = f["at_s"] - (f["detected_s"] or 0.0)
            recovered = killed + f["recovered_s"]
            after = [t for t, c in enumerate(commits) if c is not None and c >= recovered]
            if after:
                row["recovery_step"] = after[0]
                row["failed_step_s"] = round(intervals[after[0]], 5)
        rows.append(row)
    return rows


def one_run(prefix: list[str], out: Path, kind: str, seed: int, steps: int, warmup: int,
            kills: tuple[tuple[int, int, str], ...], timeout_s: float) -> dict[str, Any]:
    args = [*JOB, "--steps", str(steps), "--seed", str(seed)]
    if kind == "kills":
        args += [f"--kill=step={s},replica={r},phase={p}" for s, r, p in kills]
    load = round(os.getloadavg()[0], 2)
    cpu, began = children_cpu_s(), time.monotonic()
    summary = run_job(prefix, out, args, timeout_s)
    cpu, elapsed = children_cpu_s() - cpu, time.monotonic() - began
    dt = step_intervals(summary)
    row: dict[str, Any] = {
        "args": args, "load_1m_before": load, "cpu_s": round(cpu, 2),
        "elapsed_s": round(elapsed, 2), "wall_s": summary["wall_s"],
        "steps_committed": summary["steps_committed"],
        "step_intervals_s": [round(x, 5) for x in dt],
        "param_sha256": summary["param_sha256"],
        "param_sha256_per_step": summary["param_sha256_per_step"],
        "replicas_per_step": summary["replicas_per_step"]}
    if kind == "failure_free":
        row["step_s"] = round(statistics.median(dt[warmup:]), 5)
        row["summary_median_step_s"] = (summary["step_time"] or {}).get("median_s")
    else:
        row["failures"] = failed_steps(summary, dt)
        row["recovery_phases_s"] = summary["recovery_phases_s"]
    return row


# ------------------------------------------------------------------ statistics

def describe_values(values: list[float], digits: int = 5) -> dict[str, Any]:
    """n, median, quartiles and range."""
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": round(statistics.median(values), digits),
            "q1": round(percentile(values, 25), digits), "q3": round(percentile(values, 75), digits),
            "min": round(min(values), digits), "max": round(max(values), digits)}


def ratio_stats(per_round: list[tuple[list[float], list[float]]], seed: int = 0) -> dict[str, Any]:
    """after / before: the ratio of the medians of the pooled figures, with a 95 % bootstrap
    interval that resamples rounds (each round's before and after figures stay together)."""
    rounds = [(b, a) for b, a in per_round if b and a]
    if not rounds:
        return {"n_rounds": 0}

    def ratio(sample: list[tuple[list[float], list[float]]]) -> float:
        before = [x for b, _ in sample for x in b]
        after = [x for _, a in sample for x in a]
        return statistics.median(after) / statistics.median(before)

    rng = random.Random(seed)
    boot = sorted(ratio([rng.choice(rounds) for _ in rounds]) for _ in range(BOOTSTRAP))
    lo, hi = percentile(boot, 2.5), percentile(boot, 97.5)
    paired = [statistics.median(a) / statistics.median(b) for b, a in rounds]
    if len(rounds) < 3:
        verdict = "too few rounds"
    elif lo >= 1 - TARGET and hi <= 1 + TARGET:
        verdict = "met"
    elif lo > 1 + TARGET:
        verdict = "slower"
    elif hi < 1 - TARGET:
        verdict = "faster"
    elif hi <= 1 + TARGET:
        verdict = "no slowdown beyond 1 % (interval reaches below 0.99)"
    else:
        verdict = "not resolved"
    return {"n_rounds": len(rounds), "ratio": round(ratio(rounds), 4),
            "ci95": [round(lo, 4), round(hi, 4)], "per_round": describe_values(paired, 4),
            "verdict_1pct": verdict}


# ------------------------------------------------------------------ main

def figures(rnd: dict[str, Any], build: str, key: str, phase: str | None = None) -> list[float]:
    """One round's figures of one build: its step time, or per injected failure (of `phase`)
    a latency, or per recovery a phase of the controller's split."""
    if key == "step_s":
        return [rnd["failure_free"][build]["step_s"]]
    if key in SPLIT:
        return [r[key] for r in rnd["kills"][build]["recovery_phases_s"] if key in r]
    # Only the injected kills: a failure the job had on its own is an anomaly, listed apart.
    return [f[key] for f in rnd["kills"][build]["failures"] if f.get(key) is not None
            and f["cause"] == "injected" and phase in (None, f["phase"])]


def analyse(result: dict[str, Any]) -> None:
    """Add the figures (spread, ratios) and the checks to `result`, from its raw rounds."""
    rounds, steps = result["rounds"], result["job"]["steps"]
    kills = result["job"]["kills"]

    def compare(key: str, phase: str | None = None) -> dict[str, Any]:
        return {**{b: describe_values([x for r in rounds for x in figures(r, b, key, phase)])
                   for b in BUILDS},
                "after_over_before": ratio_stats([(figures(r, "before", key, phase),
                                                   figures(r, "after", key, phase))
                                                  for r in rounds])}

    result["figures"] = {key: compare(key) for key in KEYS}
    phases = sorted({k.split("phase=")[1] for k in kills})
    result["figures_by_kill_phase"] = {p: {key: compare(key, p) for key in
                                           ("recovered_s", "detected_s", "failed_step_s")}
                                       for p in phases}

    def digest(rnd: dict[str, Any], kind: str, build: str) -> Any:
        return rnd[kind][build]["param_sha256"]

    def per_step(rnd: dict[str, Any], kind: str, build: str) -> Any:
        return rnd[kind][build]["param_sha256_per_step"]

    result["anomalies"] = [
        {"round": r["round"], "build": b, **f} for r in rounds for b in BUILDS
        for f in r["kills"][b]["failures"] if f["cause"] != "injected"]
    result["checks"] = {
        "all_steps_committed": all(r[k][b]["steps_committed"] == steps
                                   for r in rounds for k in KINDS for b in BUILDS),
        "every_kill_recorded": all(len(figures(r, b, "recovered_s")) == len(kills)
                                   for r in rounds for b in BUILDS),
        "extra_failures": len(result["anomalies"]),
        "kills_run_final_digest_equals_its_failure_free_twin": all(
            digest(r, "failure_free", b) is not None
            and digest(r, "kills", b) == digest(r, "failure_free", b)
            for r in rounds for b in BUILDS),
        "kills_run_every_step_digest_equals_its_twin": all(
            per_step(r, "kills", b) == per_step(r, "failure_free", b)
            for r in rounds for b in BUILDS),
        "before_and_after_same_digests_every_step": all(
            per_step(r, k, "before") == per_step(r, k, "after") for r in rounds for k in KINDS)}


def report(result: dict[str, Any]) -> None:
    for key in KEYS:
        s = result["figures"][key]
        r = s["after_over_before"]
        if not r.get("n_rounds"):
            continue
        b, a = s["before"], s["after"]
        print(f"{key:<14} before {b['median'] * 1000:8.1f} ms (IQR {b['q1'] * 1000:.1f}-"
              f"{b['q3'] * 1000:.1f}, n {b['n']})  after {a['median'] * 1000:8.1f} ms (IQR "
              f"{a['q1'] * 1000:.1f}-{a['q3'] * 1000:.1f}, n {a['n']})  after/before "
              f"{r['ratio']:.4f} [{r['ci95'][0]:.4f}, {r['ci95'][1]:.4f}]  {r['verdict_1pct']}")
    for phase, keys in result["figures_by_kill_phase"].items():
        print(f"  {phase:<8} " + "  ".join(
            f"{key} x{v['after_over_before'].get('ratio')} {v['after_over_before'].get('ci95')}"
            for key, v in keys.items()))
    for a in result["anomalies"]:
        print(f"anomaly: round {a['round']} {a['build']}: {a['cause']} failure of replica "
              f"{a['replica']} at step {a['step']} ({a['phase']})")
    print(f"checks: {result['checks']}")


def measure(args: argparse.Namespace, kills: tuple[tuple[int, int, str], ...],
            out: Path) -> dict[str, Any]:
    prefixes = {"before": build_command(args.before), "after": build_command(args.after)}
    builds = {b: describe(b, prefixes[b]) for b in BUILDS}
    env_before = {**environment(), **foreign_load()}
    began = time.monotonic()
    rounds: list[dict[str, Any]] = []
    for i in range(args.rounds):
        order = list(BUILDS) if i % 2 == 0 else list(reversed(BUILDS))
        rnd: dict[str, Any] = {"round": i, "seed": i, "order": order,
                               **{k: {} for k in KINDS}}
        for kind in KINDS:
            for build in order:
                run_dir = out / "runs" / f"{i:02d}-{kind}-{build}"
                rnd[kind][build] = one_run(prefixes[build], run_dir, kind, i, args.steps,
                                           args.warmup, kills, args.timeout)
                if not args.keep_runs:  # results.json keeps every figure
                    shutil.rmtree(run_dir)
        rnd["final_digests"] = {f"{kind}/{b}": rnd[kind][b]["param_sha256"]
                                for kind in KINDS for b in BUILDS}
        rounds.append(rnd)
        ff = {b: rnd["failure_free"][b]["step_s"] for b in BUILDS}
        rec = {b: [f["recovered_s"] for f in rnd["kills"][b]["failures"]] for b in BUILDS}
        print(f"round {i + 1}/{args.rounds} ({time.monotonic() - began:.0f}s, order {order}, load "
              f"{os.getloadavg()[0]:.2f}): step before {ff['before'] * 1000:.1f} ms after "
              f"{ff['after'] * 1000:.1f} ms (x{ff['after'] / ff['before']:.3f}); recovered "
              f"before {rec['before']} after {rec['after']}; final digests equal "
              f"{len(set(rnd['final_digests'].values())) == 1}", file=sys.stderr, flush=True)
    if not args.keep_runs:
        shutil.rmtree(out / "runs", ignore_errors=True)
    return {
        "benchmark": "before_after", "issue": 19,
        "job": {"args": JOB, "steps": args.steps, "warmup": args.warmup,
                "kills": [f"step={s},replica={r},phase={p}" for s, r, p in kills],
                "command_failure_free": [*prefixes["after"], "run", "--quiet", "--out", "DIR",
                                         *rounds[0]["failure_free"]["after"]["args"]]
                if rounds else None,
                "command_kills": [*prefixes["after"], "run", "--quiet", "--out", "DIR",
                                  *rounds[0]["kills"]["after"]["args"]] if rounds else None},
        "command": [sys.executable, *sys.argv],
        "builds": builds, "rounds_run": len(rounds),
        "bench_wall_s": round(time.monotonic() - began, 1),
        "target": f"after/before within {TARGET:.0%}: bootstrap 95% interval inside "
                  f"[{1 - TARGET}, {1 + TARGET}]",
        "environment_before": env_before, "environment": {**environment(), **foreign_load()},
        "rounds": rounds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="`recover` executable or venv python")
    parser.add_argument("--after", help="`recover` executable or venv python")
    parser.add_argument("--out", required=True, help="results.json goes here")
    parser.add_argument("--rounds", type=int, default=6,
                        help="rounds; each runs both builds failure-free and with kills")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the step time")
    parser.add_argument("--kill-steps", default=",".join(str(s) for s, _, _ in KILLS),
                        help="the steps of the three kills (forward, reduce, commit)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run")
    parser.add_argument("--keep-runs", action="store_true",
                        help="keep each run's folder (summary.json, logs/)")
    parser.add_argument("--reanalyse", action="store_true",
                        help="run nothing: recompute the figures of OUT/results.json from its "
                             "raw rounds")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    if args.reanalyse:
        result = json.loads((out / "results.json").read_text())
    else:
        if not args.before or not args.after:
            parser.error("--before and --after are required (unless --reanalyse)")
        kill_steps = [int(s) for s in args.kill_steps.split(",")]
        if len(kill_steps) != len(KILLS) or max(kill_steps) >= args.steps:
            parser.error(f"--kill-steps: {len(KILLS)} steps below --steps")
        kills = tuple((s, r, p) for s, (_, r, p) in zip(kill_steps, KILLS, strict=True))
        out.mkdir(parents=True, exist_ok=True)
        result = measure(args, kills, out)
    analyse(result)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    report(result)
    print(f"results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
