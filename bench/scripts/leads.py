"""Proportional quotas when one replica does more between steps (issue 21): the demo's job
(examples/batchnorm.py at the demo's size, 4 replicas on 2 agents, -M 16) with the
example's evaluation on the first replica after every commit, side by side:

  uniform       --policy recover       (M/R each, whatever the speeds)
  proportional  --policy proportional  (this build: quotas planned with each replica's
                                        lead, the time from a commit to its next first
                                        microbatch)
  before        --policy proportional  on the build in --before DIR (DIR/recover), e.g.
                                        the commit before leads

    python bench/scripts/leads.py --out runs/leads --rounds 6 [--before /tmp/old] [--compute-ms 10]

`--compute-ms C` adds C ms of emulated accelerator time (a sleep) to every microbatch: a
replica's microbatches then do not share the two cores with the others', as on hosts
where each replica has its own accelerator; the evaluation still runs on the CPU.

The order of the variants rotates each round. Per run: the median commit-to-commit step
(steps 3..) and the two most common quotas of steps 3.. (microbatches_by_replica_per_step);
ratios of the medians over rounds, and per round. BENCHMARKS.md section 10 records them.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from recover.bench.overhead import median_step_s

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "batchnorm.py"


def run(args: argparse.Namespace, variant: str, out: Path) -> dict:
    policy = "recover" if variant == "uniform" else "proportional"
    env = dict(os.environ)
    if variant == "before":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(args.before), env.get("PYTHONPATH"))
                                            if p)
    cmd = [sys.executable, "-m", "recover.cli.main", "run", "--out", str(out), "--quiet",
           "--no-plot", "--replicas", "4", "--agents", "2", "--steps", str(args.steps), "-M", "16",
           "--seed", "1", "--reduce", args.reduce, "--policy", policy, "--", "python",
           str(EXAMPLE), "--width", str(args.width), "--eval-every", str(args.eval_every)]
    if args.compute_ms:
        cmd[cmd.index("--"):cmd.index("--")] = ["--compute-ms", str(args.compute_ms)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=args.run_timeout)
    if done.returncode != 0:
        raise SystemExit(f"{out}: {done.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    loads = [tuple(sorted((int(r), n) for r, n in step.items()))
             for step in summary["microbatches_by_replica_per_step"][3:]]
    common = collections.Counter(loads).most_common(2)
    return {"step_s": median_step_s(summary, 3), "plans": [[dict(p), n] for p, n in common],
            "sha": summary["param_sha256"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--width", type=int, default=76, help="76: the demo's 106k parameters")
    parser.add_argument("--eval-every", type=int, default=1)
    parser.add_argument("--reduce", default="fast", choices=("fast", "exact"))
    parser.add_argument("--compute-ms", type=float, default=0.0)
    parser.add_argument("--before", type=Path, help="a build to compare with (DIR/recover)")
    parser.add_argument("--run-timeout", type=float, default=600)
    args = parser.parse_args()
    variants = ["uniform", "proportional"] + (["before"] if args.before else [])
    if args.before and not (args.before / "recover").is_dir():
        parser.error(f"--before {args.before}: no recover/ in it")
    args.out.mkdir(parents=True, exist_ok=True)
    rounds: list[dict] = []
    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        row = {}
        for variant in order:
            row[variant] = run(args, variant, args.out / f"r{r}-{variant}")
            print(f"round {r} {variant}: {row[variant]['step_s'] * 1000:.1f} ms/step, plans "
                  f"{row[variant]['plans']}", flush=True)
        rounds.append(row)
    median = {v: statistics.median(row[v]["step_s"] for row in rounds) for v in variants}
    for a, b in [("proportional", "uniform"), ("proportional", "before"), ("before", "uniform")]:
        if a in median and b in median:
            per_round = [row[a]["step_s"] / row[b]["step_s"] for row in rounds]
            print(f"{a} / {b}: {median[a] / median[b]:.3f} (per round "
                  f"{', '.join(f'{x:.3f}' for x in per_round)})")
    (args.out / "results.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "rounds": rounds,
         "median_step_s": median}, indent=1) + "\n")


if __name__ == "__main__":
    main()
