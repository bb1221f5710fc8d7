"""What reducing a model's buffers costs a step (issue 23): `recover run` of
examples/batchnorm.py (a ConvNet with BatchNorm) with `--buffers reduce` (the running
statistics reduced like gradients, inside the guarantee) against `--buffers local` (each
replica's own, outside it), alternating, several rounds, in fast and exact mode. CPU-bound
steps (no emulated compute): the reduction's share is the largest there.

    python bench/scripts/buffers_overhead.py --rounds 5 --out bench/results/buffers-overhead

`--pin` gives each worker a core of its own (replica k on core k mod the cores, every thread
of it, re-applied while the job runs), the control plane floating: whether the buffers'
job-level cost comes from two replicas' small ops sharing the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
from pathlib import Path

from recover.bench.overhead import median_step_s

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "batchnorm.py"


SPAWNED = re.compile(r"spawned worker pid (\d+) on slot .*replica=(\d+)")


def pin_workers(logs: Path, done: threading.Event) -> None:
    """Until `done`: every worker the agents' logs name, all its threads, on core replica
    mod the cores (threads started later are caught by the next pass)."""
    cores = sorted(os.sched_getaffinity(0))
    while not done.wait(0.05):
        for log in logs.glob("agent-*.log"):
            for pid, replica in SPAWNED.findall(log.read_text()):
                try:
                    for tid in os.listdir(f"/proc/{pid}/task"):
                        os.sched_setaffinity(int(tid), {cores[int(replica) % len(cores)]})
                except OSError:
                    pass  # ended, or a thread that ended between listing and pinning


def run_job(command: list[str], logs: Path, pin: bool) -> subprocess.CompletedProcess[str]:
    done = threading.Event()
    pinner = threading.Thread(target=pin_workers, args=(logs, done), daemon=True)
    if pin:
        pinner.start()
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=600)
    finally:
        done.set()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--width", type=int, default=8, help="the example's channel width")
    parser.add_argument("--replicas", type=int, default=2,
                        help="1: the buffers' own cost, without a second worker on the cores")
    parser.add_argument("-M", "--microbatches", type=int, default=4,
                        help="the job's M (the demo's: 16 over 4 replicas)")
    parser.add_argument("--eval-every", type=int, default=1,
                        help="the example's eval on the first replica every N steps (0: none)")
    parser.add_argument("--modes", default="fast,exact")
    parser.add_argument("--pin", action="store_true",
                        help="each worker on a core of its own (replica k: core k mod cores)")
    parser.add_argument("--out", default="runs/buffers-overhead")
    args = parser.parse_args()
    out = Path(args.out)
    modes = args.modes.split(",")
    variants = [(mode, buffers) for mode in modes for buffers in ("local", "reduce")]
    results: dict[str, list[float]] = {f"{m} {b}": [] for m, b in variants}
    for round_ in range(args.rounds):
        # Rotate the first variant, so that none always runs on a cold or warm machine.
        order = variants[round_ % len(variants):] + variants[:round_ % len(variants)]
        for mode, buffers in order:
            run = out / f"r{round_}-{mode}-{buffers}"
            done = run_job(
                [sys.executable, "-m", "recover.cli.main", "run", "--out", str(run), "--quiet",
                 "--no-plot", "--replicas", str(args.replicas), "--steps", str(args.steps),
                 "-M", str(args.microbatches), "--seed", "1", "--reduce", mode, "--",
                 "python", str(EXAMPLE), "--buffers", buffers, "--width", str(args.width),
                 "--eval-every", str(args.eval_every)],
                run / "logs", args.pin)
            if done.returncode != 0:
                raise SystemExit(f"{run}: {done.stderr[-2000:]}")
            summary = json.loads((run / "summary.json").read_text())
            results[f"{mode} {buffers}"].append(median_step_s(summary, 3))
            print(f"round {round_}: {mode} {buffers}: {results[f'{mode} {buffers}'][-1] * 1000:.1f} "
                  "ms/step", flush=True)
    median = {label: statistics.median(times) for label, times in results.items()}
    ratios = {mode: median[f"{mode} reduce"] / median[f"{mode} local"] for mode in modes}
    per_round = {mode: [r / loc for r, loc in zip(results[f"{mode} reduce"],
                                                  results[f"{mode} local"], strict=True)]
                 for mode in modes}
    for mode in modes:
        print(f"{mode}: reduce {median[f'{mode} reduce'] * 1000:.1f} ms, local "
              f"{median[f'{mode} local'] * 1000:.1f} ms: {ratios[mode]:.3f}x (per round "
              f"{', '.join(f'{r:.3f}' for r in per_round[mode])}; target <= 1.02)")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({
        "rounds": results, "median_s": median, "reduce_vs_local": ratios,
        "per_round": per_round, "target": 1.02, "steps": args.steps, "width": args.width,
        "replicas": args.replicas, "microbatches": args.microbatches, "pinned": args.pin,
        "eval_every": args.eval_every},
        indent=2) + "\n")


if __name__ == "__main__":
    main()
