"""Exact mode's passes over one microbatch's gradient on the CPU, each timed alone.

`ExactAccumulator.after_microbatch` (trainer/reduction.py, exactparts.add_range) makes five
passes over a float32 gradient bucket: scale it (times a per-element power of two), take its
min and max (does it fit?), round it, widen it to float64 and add it to the float64 sum.
This times each on `--elements` float32 values (9.5M: the 9.5M-parameter model of
BENCHMARKS.md 4e), one thread, medians of `--reps`, and the single-pass alternatives torch
offers, to show which passes could go:

    python bench/scripts/exact_passes.py [--elements 9500000 --reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch


def timed(op: Callable[[], object], reps: int) -> float:
    op()  # first touch outside the clock
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        op()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=9_500_000)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as a CPU replica's worker
    n = args.elements
    grad = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 1e-3
    scale = torch.full((n,), 2.0 ** 20)
    scaled = torch.empty(n)
    wide = torch.empty(n, dtype=torch.float64)
    total = torch.zeros(n, dtype=torch.float64)
    passes = [
        ("scale: grad x per-element scale (float32)", lambda: torch.mul(grad, scale, out=scaled)),
        ("fits: aminmax (float32)", lambda: torch.aminmax(scaled)),
        ("round_ (float32)", lambda: scaled.round_()),
        ("widen: copy_ float32 -> float64", lambda: wide.copy_(scaled)),
        ("add_ float64 += float64", lambda: total.add_(wide)),
    ]
    alternatives = [
        ("scale by one scalar instead (float32)", lambda: torch.mul(grad, 2.0 ** 20, out=scaled)),
        ("scale straight into float64 (mixed-type mul)", lambda: torch.mul(grad, scale, out=wide)),
        ("add_ float64 += float32 (mixed-type, no widen)", lambda: total.add_(scaled)),
        ("round_ (float64)", lambda: wide.round_()),
    ]
    print(f"{n / 1e6:.1f}M float32 elements ({n * 4 / 1e6:.0f} MB), one thread, torch "
          f"{torch.__version__}, medians of {args.reps}")
    print("| pass | ms |\n|---|---|")
    total_ms = 0.0
    for name, op in passes:
        ms = timed(op, args.reps)
        total_ms += ms
        print(f"| {name} | {ms:.2f} |")
    print(f"| **the five, a microbatch** | **{total_ms:.2f}** |")
    print("\n| alternative | ms |\n|---|---|")
    for name, op in alternatives:
        print(f"| {name} | {timed(op, args.reps):.2f} |")


if __name__ == "__main__":
    main()
