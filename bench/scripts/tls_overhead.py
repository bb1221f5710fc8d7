"""What mutual TLS costs: failure-free step time and recovery latency, `--tls` vs plain.

Whole `recover run` jobs (controller, 2 agents, 4 workers, exact reduction,
`--compute-ms 30` of emulated accelerator time per microbatch), identical
except for `--tls` (a throwaway CA and certificates in OUT/tls; mutual TLS on
every gRPC channel: launcher, agents and controller). In pairs, the order
flipping every pair so that load drift hits both; both runs of a pair use the
same seed. Each job SIGKILLs replica 1 at step KILLS[0] and replica 2 at step
KILLS[1] (mid-backward, `--kill`), so one run gives:

(a) failure-free step time: the median of the commit-to-commit intervals of
    steps 3 .. KILLS[0]-1 (summary.json `committed_at_s_per_step`; steps 0-2
    warm up), all 4 replicas; ratio TLS / plain per pair, and the median;
(b) recovery latency per kill: kill -> every survivor computes again
    (summary.json `failures[].recovered_s`, the same figure `recover bench
    recovery` reports), and its part inside the controller, detection ->
    `recovered` event (OUT/logs/controller.log); ratio of the medians;
(c) the CPU seconds of the whole job (every process, reaped), and whether both
    runs of a pair end with bitwise identical parameters (`param_sha256_per_step`).

    python bench/scripts/tls_overhead.py --pairs 10 --out bench/results/tls-overhead   # ~8.5 min
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from recover.bench.env import environment, foreign_load

sys.path.insert(0, str(Path(__file__).resolve().parent))
from joblog import events, run_job, spread, step_times  # noqa: E402

JOB = ["--reduce", "exact", "--replicas", "4", "-M", "12", "-B", "4", "--compute-ms", "30"]
KILLS = (30, 45)
STEP_TARGET, RECOVERY_TARGET = 1.02, 1.10


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_run(out: Path, seed: int, steps: int, tls: bool) -> dict[str, Any]:
    job = [*JOB, "--steps", str(steps), "--seed", str(seed),
           *[f"--kill=step={s},replica={r},phase=backward" for r, s in enumerate(KILLS, 1)]]
    if tls:
        job.append("--tls")
    load = round(os.getloadavg()[0], 2)
    cpu = children_cpu_s()
    summary = run_job(out, job)
    cpu = children_cpu_s() - cpu
    dt = step_times(summary)
    evs = events(out)
    recovered_at = {e.step: e.ts for e in evs if e.kind == "recovered"}
    failures = []
    for f in summary["failures"]:
        failed = next((e for e in evs if e.kind == "replica-failed" and e.step == f["step"]
                       and e.replica == f["replica"]), None)
        back = recovered_at.get(f["step"])
        failures.append({"step": f["step"], "replica": f["replica"], "detected_s": f["detected_s"],
                         "recovered_s": f["recovered_s"],
                         "controller_s": round(back - failed.ts, 4) if failed and back else None})
    if tls:
        assert (out / "tls").is_dir(), "--tls made no certificates"
    return {"args": job, "load_1m_before": load, "cpu_s": round(cpu, 2),
            "wall_s": summary["wall_s"], "steps_committed": summary["steps_committed"],
            "step_s": round(statistics.median(dt[3:KILLS[0]]), 5),
            "summary_median_step_s": summary["step_time"]["median_s"],
            "first_commit_s": round(summary["committed_at_s_per_step"][0], 3),
            "failures": failures, "param_sha256_per_step": summary["param_sha256_per_step"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--keep-runs", action="store_true",
                        help="keep each run's folder (summary.json, logs/, tls/)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env_before = {**environment(), **foreign_load()}
    pairs = []
    for i in range(args.pairs):
        order = ["plain", "tls"] if i % 2 == 0 else ["tls", "plain"]
        pair: dict[str, Any] = {"pair": i, "seed": 1 + i % 3, "first": order[0]}
        for which in order:
            run_dir = out / f"{which}-{i}"
            pair[which] = one_run(run_dir, pair["seed"], args.steps, which == "tls")
            if not args.keep_runs:  # results.json keeps what was measured
                shutil.rmtree(run_dir)
        plain, tls = pair["plain"], pair["tls"]
        pair["step_ratio"] = round(tls["step_s"] / plain["step_s"], 4)
        pair["cpu_ratio"] = round(tls["cpu_s"] / plain["cpu_s"], 4)
        pair["bitwise_equal"] = plain.pop("param_sha256_per_step") == tls.pop("param_sha256_per_step")
        pairs.append(pair)
        print(f"pair {i}: step plain {plain['step_s'] * 1000:.1f} ms, tls {tls['step_s'] * 1000:.1f} ms"
              f" (x{pair['step_ratio']:.3f}); recovered plain "
              f"{[f['recovered_s'] for f in plain['failures']]} tls "
              f"{[f['recovered_s'] for f in tls['failures']]}; CPU x{pair['cpu_ratio']:.3f}; "
              f"bitwise {pair['bitwise_equal']}", file=sys.stderr, flush=True)

    def pooled(which: str, key: str) -> list[float]:
        return [f[key] for p in pairs for f in p[which]["failures"] if f[key] is not None]

    rec = {w: {k: spread(pooled(w, k)) for k in ("detected_s", "recovered_s", "controller_s")}
           for w in ("plain", "tls")}
    step_ratio = statistics.median(p["step_ratio"] for p in pairs)
    rec_ratio = rec["tls"]["recovered_s"]["median"] / rec["plain"]["recovered_s"]["median"]
    ctl_ratio = rec["tls"]["controller_s"]["median"] / rec["plain"]["controller_s"]["median"]
    result = {
        "benchmark": "tls_overhead", "job_args": JOB, "steps": args.steps, "kills": KILLS,
        "pairs": pairs,
        "step_s": {w: spread([p[w]["step_s"] for p in pairs], 5) for w in ("plain", "tls")},
        "step_ratio": spread([p["step_ratio"] for p in pairs]),
        "cpu_ratio": spread([p["cpu_ratio"] for p in pairs]),
        "first_commit_s": {w: spread([p[w]["first_commit_s"] for p in pairs], 3)
                           for w in ("plain", "tls")},
        "recovery": rec, "recovered_ratio": round(rec_ratio, 4),
        "controller_recovery_ratio": round(ctl_ratio, 4),
        "all_bitwise_equal": all(p["bitwise_equal"] for p in pairs),
        "all_steps_committed": all(p[w]["steps_committed"] == args.steps
                                   for p in pairs for w in ("plain", "tls")),
        "targets": {"step_ratio_le_1_02": step_ratio <= STEP_TARGET,
                    "recovered_ratio_le_1_10": rec_ratio <= RECOVERY_TARGET},
        "environment_before": env_before, "environment": {**environment(), **foreign_load()},
        "finished_at": time.time()}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    sr, cr = result["step_ratio"], result["cpu_ratio"]
    print(f"step time TLS/plain: median {sr['median']} ({sr['min']}-{sr['max']}, {sr['n']} pairs), "
          f"target <= {STEP_TARGET}: {'met' if step_ratio <= STEP_TARGET else 'NOT met'}")
    for w in ("plain", "tls"):
        r = rec[w]
        print(f"{w}: kill->recovered median {r['recovered_s']['median']} s "
              f"({r['recovered_s']['min']}-{r['recovered_s']['max']}, n {r['recovered_s']['n']}), "
              f"detected {r['detected_s']['median']} s, detection->recovered (controller) "
              f"{r['controller_s']['median']} s")
    print(f"recovery TLS/plain: {rec_ratio:.3f} (controller part {ctl_ratio:.3f}), target <= "
          f"{RECOVERY_TARGET}: {'met' if rec_ratio <= RECOVERY_TARGET else 'NOT met'}; CPU "
          f"TLS/plain {cr['median']} ({cr['min']}-{cr['max']}); bitwise equal: "
          f"{result['all_bitwise_equal']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
