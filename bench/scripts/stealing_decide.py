"""Work-stealing's decision at scale: controller/stealing.py's `decide` against the
quadratic first version (tests/unit/stealing_reference.py), side by side on the same books.

    python bench/scripts/stealing_decide.py [--sizes 32,128,512,1024]

A book: N members of 4 microbatches each, a quarter idle, the others 0-2 done, speeds
0.05-0.2 s, seeded; per size the median of 5 calls of each (both return the same
decisions: asserted here, and property-tested in tests/unit/test_stealing.py).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from recover.controller.stealing import Member, decide  # noqa: E402
from tests.unit.stealing_reference import reference_decide  # noqa: E402

NOW = 0.1


def book(size: int, seed: int = 1) -> dict[int, Member]:
    rng = random.Random(seed)
    return {r: Member(r, tuple(range(4 * r, 4 * r + 4)), rng.choice([0, 1, 2, 4]),
                      rng.uniform(0.05, 0.2), rng.uniform(0, NOW)) for r in range(size)}


def median_call(fn, members: dict[int, Member]) -> float:
    times = []
    for _ in range(5):
        started = time.perf_counter()
        fn(members, NOW)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="32,128,512,1024")
    args = parser.parse_args()
    print("| members | steals | first version | now | speed-up |\n|---|---|---|---|---|")
    for size in (int(s) for s in args.sizes.split(",")):
        members = book(size)
        decided = decide(members, NOW)
        assert decided == reference_decide(members, NOW)
        before, after = median_call(reference_decide, members), median_call(decide, members)
        print(f"| {size} | {len(decided.steals)} | {before * 1000:.1f} ms | {after * 1000:.1f} ms "
              f"| {before / after:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
