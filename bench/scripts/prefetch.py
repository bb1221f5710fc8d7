"""Prefetch vs synchronous loading, side by side in one run: `recover run` of
bench/scripts/prefetch_job.py (16 samples per microbatch, 5 ms to produce each) with
batches loaded in line and on 2 loader threads, alternating, several rounds.

    python bench/scripts/prefetch.py --rounds 3 --out bench/results/prefetch
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

JOB = Path(__file__).with_name("prefetch_job.py")


def step_s(summary: dict) -> float:
    """Median seconds between commits, the first two steps (start-up) left out."""
    t = [x for x in summary["committed_at_s_per_step"] if x is not None]
    return statistics.median(b - a for a, b in zip(t[2:], t[3:], strict=False))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="runs/prefetch")
    parser.add_argument("--decode-ms", type=float, default=5.0)
    args = parser.parse_args()
    out = Path(args.out)
    results: dict[str, list[float]] = {"in line": [], "2 loader threads": []}
    for round_ in range(args.rounds):
        for label, workers in (("in line", 0), ("2 loader threads", 2)):
            run = out / f"r{round_}-w{workers}"
            done = subprocess.run(
                [sys.executable, "-m", "recover.cli.main", "run", "--out", str(run), "--quiet",
                 "--no-plot", "--replicas", "2", "--steps", "12", "-M", "4", "--seed", "1",
                 "--", "python", str(JOB), "--decode-ms", str(args.decode_ms),
                 "--loader-workers", str(workers)], capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise SystemExit(f"{run}: {done.stderr[-2000:]}")
            results[label].append(step_s(json.loads((run / "summary.json").read_text())))
            print(f"round {round_}: {label}: {results[label][-1] * 1000:.0f} ms/step", flush=True)
    summary = {label: statistics.median(times) for label, times in results.items()}
    ideal = 2 * 16 * args.decode_ms / 1000  # one replica's two microbatches' decoding
    print(f"median step: in line {summary['in line'] * 1000:.0f} ms, 2 loader threads "
          f"{summary['2 loader threads'] * 1000:.0f} ms, ratio "
          f"{summary['in line'] / summary['2 loader threads']:.2f}x "
          f"(decoding alone, in line: {ideal * 1000:.0f} ms per step)")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"rounds": results, "median_s": summary},
                                                 indent=2) + "\n")


if __name__ == "__main__":
    main()
