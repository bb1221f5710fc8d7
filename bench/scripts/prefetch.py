"""Prefetch vs synchronous loading, side by side in one run: `recover run` of
bench/scripts/prefetch_job.py (16 samples per microbatch, 5 ms to produce each) with
batches loaded in line and on 2 loader threads, and the same job with no loading cost at
all (the target: loaders ahead within 5 % of it), alternating, several rounds.
`--compute-ms` gives each microbatch emulated compute for the loaders to hide behind.

    python bench/scripts/prefetch.py --rounds 3 --out bench/results/prefetch
    python bench/scripts/prefetch.py --rounds 5 --compute-ms 50 --out bench/results/prefetch-compute
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from recover.bench.overhead import median_step_s

JOB = Path(__file__).with_name("prefetch_job.py")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="runs/prefetch")
    parser.add_argument("--decode-ms", type=float, default=5.0)
    parser.add_argument("--compute-ms", type=float, default=0.0,
                        help="emulated compute per microbatch (recover run --compute-ms)")
    args = parser.parse_args()
    out = Path(args.out)
    variants = (("in line", 0, args.decode_ms), ("2 loader threads", 2, args.decode_ms),
                ("no loading cost", 0, 0.0))
    results: dict[str, list[float]] = {label: [] for label, _, _ in variants}
    for round_ in range(args.rounds):
        for label, workers, decode_ms in variants:
            run = out / f"r{round_}-w{workers}-d{decode_ms:g}"
            done = subprocess.run(
                [sys.executable, "-m", "recover.cli.main", "run", "--out", str(run), "--quiet",
                 "--no-plot", "--replicas", "2", "--steps", "12", "-M", "4", "--seed", "1",
                 "--compute-ms", str(args.compute_ms),
                 "--", "python", str(JOB), "--decode-ms", str(decode_ms),
                 "--loader-workers", str(workers)], capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise SystemExit(f"{run}: {done.stderr[-2000:]}")
            results[label].append(median_step_s(json.loads((run / "summary.json").read_text()), 2))
            print(f"round {round_}: {label}: {results[label][-1] * 1000:.0f} ms/step", flush=True)
    summary = {label: statistics.median(times) for label, times in results.items()}
    ideal = 2 * 16 * args.decode_ms / 1000  # one replica's two microbatches' decoding
    ahead = summary["2 loader threads"] / summary["no loading cost"]
    print(f"median step: in line {summary['in line'] * 1000:.0f} ms, 2 loader threads "
          f"{summary['2 loader threads'] * 1000:.0f} ms, no loading cost "
          f"{summary['no loading cost'] * 1000:.0f} ms; in line / loaders "
          f"{summary['in line'] / summary['2 loader threads']:.2f}x, loaders / no cost "
          f"{ahead:.3f}x (target <= 1.05) (decoding alone, in line: {ideal * 1000:.0f} ms per "
          f"step; compute {args.compute_ms:g} ms per microbatch)")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({
        "rounds": results, "median_s": summary, "compute_ms": args.compute_ms,
        "decode_ms": args.decode_ms, "loaders_vs_no_cost": round(ahead, 4),
        "target": 1.05, "target_met": ahead <= 1.05}, indent=2) + "\n")


if __name__ == "__main__":
    main()
