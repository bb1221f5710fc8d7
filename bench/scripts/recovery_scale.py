"""Recovery at scale (issue 25 item 2): kill -> survivors computing with 4, 8, 16 and 32
replicas, each recovery split by phase, the sizes interleaved round by round.

Each round runs `--runs-per-round` runs of `recover bench recovery`'s schedule (real `recover
run` jobs: controller, 2 agents holding every slot, 3 SIGKILLs per run) at every size, in an
order that flips every round, so load drifts hit all sizes alike. M is 16, or the replicas
when more (each replica computes at least one microbatch of the demo model, -B 8: on 2 cores
32 CPU-bound replicas still step in well under a second). The table gives, per size, the
p50 and p99 of kill -> every survivor computing again (over failures) and the p50 of each
recovery phase (detect, plan, rebuild, recompute, commit; bench/recovery.py defines them),
and each p50 as a ratio of the 4-replica one.

    python bench/scripts/recovery_scale.py --rounds 4 --out bench/results/recovery-scale
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from recover.bench import recovery

PHASES = ("detect", "plan", "rebuild", "recompute", "commit", "total")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--sizes", default="4,8,16,32")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--runs-per-round", type=int, default=2)
    parser.add_argument("--run-timeout", type=float, default=150.0)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    merged: dict[int, dict[str, list[Any]]] = {
        r: {"failures": [], "recoveries": [], "anomalies": []} for r in sizes}
    began = time.monotonic()
    for round_ in range(args.rounds):
        order = sizes if round_ % 2 == 0 else list(reversed(sizes))
        for replicas in order:
            config = recovery.RecoveryConfig(
                runs=args.runs_per_round, replicas=replicas,
                out=args.out / f"R{replicas}" / f"round{round_}", timeout_s=args.run_timeout,
                global_microbatches=max(16, replicas),
                first_run=round_ * args.runs_per_round)
            label = f"[R={replicas} round {round_ + 1}/{args.rounds}]"
            result = recovery.run(config, lambda line, label=label: print(
                f"{label} {line}", file=sys.stderr, flush=True))
            for key in merged[replicas]:
                merged[replicas][key] += result[key]
    table = summarize(merged, sizes)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(
        {"sizes": sizes, "rounds": args.rounds, "runs_per_round": args.runs_per_round,
         "wall_s": round(time.monotonic() - began, 1), "table": table, "runs": merged},
        indent=1))
    print(format_table(table))
    return 0


def summarize(merged: dict[int, dict[str, list[Any]]], sizes: list[int]) -> dict[int, Any]:
    table: dict[int, Any] = {}
    for replicas in sizes:
        failures, recoveries = merged[replicas]["failures"], merged[replicas]["recoveries"]
        table[replicas] = {
            "kills": len(failures),
            "recovered": recovery.stats([f["recovered_s"] for f in failures]),
            "split": {p: recovery.stats([r.get(p) for r in recoveries]) for p in PHASES},
            "anomalies": merged[replicas]["anomalies"]}
    return table


def format_table(table: dict[int, Any]) -> str:
    base = table[min(table)]
    lines = ["| replicas | kills | kill -> computing p50 | p99 | " + " | ".join(
        f"{p} p50" for p in PHASES) + " |", "|---" * (4 + len(PHASES)) + "|"]
    for replicas, row in sorted(table.items()):
        cells = []
        for p in PHASES:
            p50, ref = row["split"][p].get("p50_s"), base["split"][p].get("p50_s")
            ratio = f" ({p50 / ref:.2f}x)" if p50 and ref else ""
            cells.append(f"{p50 * 1000:.1f} ms{ratio}" if p50 is not None else "-")
        rec = row["recovered"]
        ratio = rec["p50_s"] / base["recovered"]["p50_s"] if rec.get("p50_s") else 0.0
        lines.append(f"| {replicas} | {row['kills']} | {rec.get('p50_s', 0) * 1000:.1f} ms "
                     f"({ratio:.2f}x) | {rec.get('p99_s', 0) * 1000:.1f} ms | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
