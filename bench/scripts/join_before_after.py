"""A join over TLS with the digest check against a join of the build issue 22 was filed on.

Issue 22's speed target: "a join's transfer with TLS and the digest check: <= 1.2x today's
time at the demo size and at 268 MB (benchmark, side by side)". Today's time is a join of
the build before any work on that issue (`--before`, 510eafb: plain TCP, no digest): its
donor copies the snapshot, connects and streams; its joiner receives. Now the transfer runs
TLS 1.3 (then sealed records), and the joiner hashes the weights it received for the
controller to check against the committed digest.

Each round runs `transfer_throughput.py` (this checkout's, on both builds: the same
warm-up, the same clocks) once per side, `--reps` joins each, the side that goes first
alternating between rounds:

- `before`: the old build, variant `stream`, timed to the last byte landed;
- `after`: this build, `stream-tls --check-digest`, timed to the digest computed;
- `plain`: this build, `stream` (plain TCP, no digest): the stricter ratio, TLS and the
  check against this build's own plain join.

Both builds run with glibc keeping freed memory (MALLOC_MMAP_MAX_=0,
MALLOC_TRIM_THRESHOLD_=1 GiB in their environment: what `trainer/memory.py` sets in a
worker of this build; the old build had no such setting, and a benchmark of it without would
measure its page faults, not its transfer).

    git archive 510eafb --prefix=recover/ | tar -x -C /tmp/before
    python bench/scripts/join_before_after.py --before /tmp/before --mb 2 --layers 4 \
        --rounds 10 --reps 3 --out bench/results/join-before-after-demo
    python bench/scripts/join_before_after.py --before /tmp/before --rounds 6 --reps 3 \
        [--link-gbit 10] --out bench/results/join-before-after-268mb
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
SIDES = {
    "before": ("stream", False),
    "after": ("stream-tls", True),
    "plain": ("stream", False),
}
"""side -> (transfer_throughput variant, whether the joiner checks the digest)."""


def run_side(side: str, pythonpath: str, args: argparse.Namespace, folder: Path) -> list[float]:
    variant, check = SIDES[side]
    out = folder / f"{side}-{time.monotonic_ns()}"
    env = dict(os.environ, PYTHONPATH=pythonpath or os.environ.get("PYTHONPATH", ""),
               MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(1 << 30))
    command = [sys.executable, str(HERE.parent / "transfer_throughput.py"), "--variants", variant,
               "--reps", str(args.reps), "--mb", str(args.mb), "--layers", str(args.layers),
               "--out", str(out), *(["--check-digest"] if check else []),
               *(["--link-gbit", str(args.link_gbit)] if args.link_gbit else [])]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{side}: {' '.join(command)} failed:\n{done.stderr[-3000:]}")
    result = json.loads((out / "results.json").read_text())
    ran = Path(result["joining_module"]).resolve()
    old = Path(args.before).resolve()
    if (side == "before") != ran.is_relative_to(old):
        raise SystemExit(f"{side}: ran {ran}, not the build meant ({old} for `before` only)")
    return [t["join_checked"] for t in result["seconds"][variant]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True,
                        help="a folder holding the old build as `recover/`")
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--layers", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3, help="joins per side and round")
    parser.add_argument("--out", required=True)
    parser.add_argument("--link-gbit", type=float,
                        help="donor and joiner in two network namespaces over a veth shaped to "
                             "this rate (transfer_throughput.py --link-gbit; root, iproute2)")
    args = parser.parse_args()
    if not (Path(args.before) / "recover" / "trainer" / "joining.py").exists():
        parser.error(f"--before {args.before}: no recover/trainer/joining.py there")
    import recover  # this checkout, as the benchmarks run it (bench/README.md)

    # The folder holding this checkout as `recover` when run that way (bench/README.md);
    # under an editable install none is needed (""), the environment finds it.
    first = Path(list(recover.__path__)[0])
    this_build = str(first.parent) if first.is_dir() else ""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"before": args.before, "after": this_build, "plain": this_build}
    joins: dict[str, list[float]] = {side: [] for side in SIDES}
    per_round: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="join-before-after-") as scratch:
        for round_ in range(args.rounds):
            order = list(SIDES)[round_ % 3:] + list(SIDES)[:round_ % 3]
            medians = {}
            for side in order:
                times = run_side(side, paths[side], args, Path(scratch))
                joins[side] += times
                medians[side] = statistics.median(times)
            per_round.append(medians)
            print(f"round {round_}: " + ", ".join(f"{s} {medians[s] * 1000:.1f} ms" for s in SIDES)
                  + f"; after/before {medians['after'] / medians['before']:.3f}", file=sys.stderr,
                  flush=True)
    median = {side: statistics.median(v) for side, v in joins.items()}
    result = {
        "benchmark": "join_before_after", "mb": args.mb, "layers": args.layers,
        "rounds": args.rounds, "reps": args.reps, "before": args.before,
        "link_gbit": args.link_gbit,
        "join_s": {side: [round(t, 5) for t in v] for side, v in joins.items()},
        "join_s_median": {side: round(m, 5) for side, m in median.items()},
        "ratio_after_vs_before": round(median["after"] / median["before"], 3),
        "ratio_after_vs_plain": round(median["after"] / median["plain"], 3),
        "ratio_per_round": [round(r["after"] / r["before"], 3) for r in per_round],
        "target_ratio": 1.2,
        "finished_at": time.time()}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("join_s_median", "ratio_after_vs_before",
                                              "ratio_after_vs_plain", "ratio_per_round")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
