"""What checkpoints for total loss cost a failure-free job: step time with and without them.

Whole `recover run` jobs, failure-free, in alternating pairs (one with
`--checkpoint-dir D --checkpoint-every 5`, one without; the order flips every
pair), at the demo size (CPU-bound; `demo-accel`: the same with `--compute-ms 30`)
and at 9.5M parameters. Three views, from the most exposed to noise to the least:

1. across runs: the ratio of summary.json's median step time, per pair and
   the median over pairs (on 2 shared cores identical runs differ by ~10 %);
2. within the checkpointing run: the steps right after a checkpoint was taken
   (its copy sits in the interval that ends at that step's commit) vs the
   other steps of the same run;
3. the training loop's own cost, reported by the writer in each
   `checkpoint-written` event ("X ms copying at the step boundary"; the write
   itself runs on a background thread), amortized over the interval and
   divided by the step time: the robust number here.

    python bench/scripts/checkpoint_overhead.py --pairs 4 --big-pairs 2 \
        --out bench/results/checkpoint-overhead   # ~6-9 min
    python bench/scripts/checkpoint_overhead.py --sizes demo-accel --pairs 4 \
        --out bench/results/checkpoint-overhead-accel   # ~3-5 min
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from recover.bench.env import environment

sys.path.insert(0, str(Path(__file__).resolve().parent))
from joblog import events, run_job, spread, step_times  # noqa: E402

SIZES = {
    "demo": ["--replicas", "4", "-M", "16", "-B", "8", "--steps", "60"],
    "9.5M": ["--replicas", "2", "-M", "8", "-B", "8", "--n-layer", "3", "--n-embd", "512",
             "--n-head", "8", "--steps", "30"],
    # Accelerator-like: each microbatch also sleeps 30 ms, so the cores have idle time for
    # the background write, as they would next to a GPU (BENCHMARKS.md "What is emulated").
    "demo-accel": ["--replicas", "4", "-M", "16", "-B", "8", "--steps", "60", "--compute-ms", "30"],
}
EVERY = 5
TARGET = 1.01
WRITTEN = re.compile(r"(\d+) bytes written in ([\d.]+)s in the background \(([\d.]+) ms copying")


def one_run(out: Path, job: list[str], ckpt: Path | None) -> dict[str, Any]:
    """A job's median step time, and with a checkpoint dir, its checkpoints' costs."""
    args = job if ckpt is None else [*job, "--checkpoint-dir", str(ckpt),
                                      "--checkpoint-every", str(EVERY)]
    load = round(os.getloadavg()[0], 2)
    summary = run_job(out, args)
    dt = step_times(summary)
    res: dict[str, Any] = {"median_step_s": summary["step_time"]["median_s"],
                           "wall_s": summary["wall_s"], "load_1m_before": load}
    if ckpt is None:
        return res
    written = [(e.step, WRITTEN.search(e.message)) for e in events(out)
               if e.kind == "checkpoint-written"]
    copies = [float(m[3]) / 1000 for _, m in written if m]
    # The copy for "the state before step s" happens after step s-1 commits, so it lands
    # in the interval that ends with step s's commit. Skip the warm-up steps 0-2.
    at_ckpt = [dt[t] for t in range(3, len(dt)) if t % EVERY == 0]
    others = [dt[t] for t in range(3, len(dt)) if t % EVERY != 0]
    files = sorted(ckpt.glob("ckpt-*.rcv"))
    # A checkpoint still being written when the next is due makes the next one skipped.
    skipped = sum(p.read_text().count("skipped: the previous one is still being written")
                  for p in (out / "logs").glob("replica-*.log"))
    steps = summary["steps_committed"]
    res.update({
        "checkpoints_reported": len(written), "checkpoints_due": steps // EVERY,
        "files_kept": [p.name for p in files], "file_bytes": files[-1].stat().st_size if files else 0,
        "skipped_warnings": skipped,
        "copy_s": [round(c, 5) for c in copies],
        "write_s": [float(m[2]) for _, m in written if m],
        "median_copy_s": statistics.median(copies) if copies else None,
        "median_step_at_checkpoint_s": statistics.median(at_ckpt),
        "median_step_other_s": statistics.median(others),
    })
    res["within_run_ratio"] = round(res["median_step_at_checkpoint_s"] / res["median_step_other_s"], 4)
    if copies:
        # Per step, the loop pays copy/EVERY; as a fraction of the run's own median step.
        res["amortized_copy_fraction"] = round(res["median_copy_s"] / EVERY / res["median_step_s"], 5)
    return res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--pairs", type=int, default=5, help="pairs at the demo sizes")
    parser.add_argument("--big-pairs", type=int, default=3, help="pairs at 9.5M parameters")
    parser.add_argument("--sizes", default="demo,9.5M")
    parser.add_argument("--keep-runs", action="store_true", help="keep each run's folder")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env_before = environment()
    results: dict[str, Any] = {}
    for size in args.sizes.split(","):
        job = [*SIZES[size], "--seed", "1"]
        pairs = []
        for i in range(args.big_pairs if size == "9.5M" else args.pairs):
            order = ["ckpt", "plain"] if i % 2 == 0 else ["plain", "ckpt"]
            pair: dict[str, Any] = {"pair": i, "first": order[0]}
            for which in order:
                ckpt_dir = out / f"ckpt-{size}-{i}" if which == "ckpt" else None
                pair[which] = one_run(out / f"{size}-{which}-{i}", job, ckpt_dir)
                if ckpt_dir is not None:
                    shutil.rmtree(ckpt_dir)  # up to 3 x 114 MB per 9.5M run: do not keep
                if not args.keep_runs:  # results.json keeps what was measured
                    shutil.rmtree(out / f"{size}-{which}-{i}")
            pair["ratio"] = round(pair["ckpt"]["median_step_s"] / pair["plain"]["median_step_s"], 4)
            pairs.append(pair)
            c = pair["ckpt"]
            print(f"{size} pair {i}: ckpt {c['median_step_s'] * 1000:.1f} ms, plain "
                  f"{pair['plain']['median_step_s'] * 1000:.1f} ms, ratio {pair['ratio']:.3f}; "
                  f"copy median {1000 * (c['median_copy_s'] or 0):.1f} ms "
                  f"({c['checkpoints_reported']}/{c['checkpoints_due']} reported), within-run "
                  f"{c['within_run_ratio']:.3f}", file=sys.stderr, flush=True)
        cks = [p["ckpt"] for p in pairs]
        amortized = [c["amortized_copy_fraction"] for c in cks if "amortized_copy_fraction" in c]
        results[size] = {
            "job_args": job, "pairs": pairs,
            "ratio": spread([p["ratio"] for p in pairs]),
            "within_run_ratio": spread([c["within_run_ratio"] for c in cks]),
            "copy_s": spread([x for c in cks for x in c["copy_s"]], 5),
            "write_s": spread([x for c in cks for x in c["write_s"]]),
            "file_bytes": cks[-1]["file_bytes"],
            "amortized_copy_fraction": spread(amortized, 5),
            "target_met_by_median_ratio": statistics.median(p["ratio"] for p in pairs) <= TARGET,
            "target_met_by_amortized_copy": bool(amortized) and 1 + max(amortized) <= TARGET,
        }
    result = {"benchmark": "checkpoint_overhead", "every_steps": EVERY, "target_ratio": TARGET,
              "sizes": results, "environment_before": env_before, "environment": environment(),
              "finished_at": time.time()}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print("\n| size | step ratio median (range) | within-run ratio | copy ms median (range) "
          "| write s median | amortized cost |\n|---|---|---|---|---|---|")
    for size, r in results.items():
        a, w, cp = r["ratio"], r["within_run_ratio"], r["copy_s"]
        am = r["amortized_copy_fraction"]
        print(f"| {size} | {a['median']:.3f} ({a['min']:.3f}-{a['max']:.3f}) | {w['median']:.3f} "
              f"| {cp['median'] * 1000:.1f} ({cp['min'] * 1000:.1f}-{cp['max'] * 1000:.1f}) "
              f"| {r['write_s']['median']} | {100 * (am['median'] or 0):.2f} % "
              f"(max {100 * (am['max'] or 0):.2f} %) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
