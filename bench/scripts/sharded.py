"""Sharded replicas: recovery after a rank kill, and the failure-free step, against
one-process replicas, side by side in one run.

Real `recover run` jobs of `examples/hsdp.py` (FSDP2 inside each replica when it has
several ranks) or, with `--example pipeline`, of `examples/pipeline.py` (the same model in
K pipeline stages, GPipe), fast reduction, `--compute-ms 20` of emulated accelerator time per
microbatch, `--max-restarts 0` (a lost replica is not replaced in any layout, so every
layout recovers the same way), interleaved layout by layout within each round so load
drifts hit all of them:

* `R x K` for R in {2, 4} and K in {1, 2}: R replicas of K ranks. A 2-replica run has one
  kill (step 4), a 4-replica run three (steps 2, 5, 8); phases rotate over forward,
  backward, reduce, and with K = 2 the killed rank rotates over 0 and 1.
* `R x K ref`: the same layout failure-free: its median step time (from summary.json's
  `committed_at_s_per_step`) is the failure-free cost of the layout.
* `R x K torch` (K = 2): plain torch on the same layout, model, microbatches and emulated
  compute, no fault tolerance: HSDP (`hsdp_baseline.py`: FSDP2 over a replicate x shard
  mesh of one global world, gradients synchronized once per step) or pipeline x data
  parallelism (`pipeline_baseline.py`: the same stages and schedule, each stage's gradient
  allreduced across replicas once per step). The ratio ReCoVer / torch of the median step
  times is the failure-free cost of ReCoVer (fast mode).

* With `--spanning`: `R x K` (each replica's ranks on one agent) against `R x K spanning`
  (each replica's K ranks on K agents of one slot, `--agents R*K`: the replica's group met on
  its rank 0's TCP store, lost as a unit across agents), no torch baseline.
* With `--exact-cost`: no kills; for 2 x 2 and 4 x 2 the failure-free step in fast mode, in
  exact mode (each microbatch's gradient shard quantized, reduce-scattered inside the replica
  every microbatch, summed across replicas in fixed point) and plain torch's, side by side.

Recovery is kill -> every survivor computes again (the controller's `recovered_s`).

    python bench/scripts/sharded.py --rounds 4 --out bench/results/sharded
    python bench/scripts/sharded.py --rounds 4 --example pipeline --out bench/results/sharded-pipeline
    python bench/scripts/sharded.py --rounds 3 --spanning --out bench/results/sharded-spanning
    python bench/scripts/sharded.py --rounds 4 --exact-cost --out bench/results/sharded-exact
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from recover.bench.env import environment, percentile

REPO = Path(__file__).resolve().parents[2]
PHASES = ["forward", "backward", "reduce"]
STEPS = 10


def kills(replicas: int, ranks: int, round_: int) -> list[str]:
    """This round's kill specs for a layout: distinct victims, one survivor (pure)."""
    steps = [4] if replicas == 2 else [2, 5, 8]
    specs = []
    for i, step in enumerate(steps):
        spec = f"step={step},replica={1 + i},phase={PHASES[(round_ + i) % len(PHASES)]}"
        if ranks > 1:
            spec += f",rank={(round_ + i) % ranks}"
        specs.append(spec)
    return specs


def run_job(out: Path, replicas: int, ranks: int, faults: list[str],
            example: str = "hsdp", spanning: bool = False, reduce: str = "fast",
            steps: int = STEPS) -> dict[str, Any] | None:
    args = [sys.executable, "-m", "recover.cli.main", "run", "--out", str(out), "--quiet",
            "--replicas", str(replicas), "--ranks-per-replica", str(ranks), "--reduce", reduce,
            *(["--agents", str(replicas * ranks)] if spanning else []),
            "--steps", str(steps), "-M", "8", "--compute-ms", "20", "--max-restarts", "0",
            *[part for fault in faults for part in ("--kill", fault)],
            "--", "python", str(REPO / "examples" / f"{example}.py")]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        print(f"  {out.name} failed: {done.stderr.strip().splitlines()[-1:]}", flush=True)
        return None
    return json.loads((out / "summary.json").read_text())


def baseline_step(replicas: int, ranks: int, example: str = "hsdp",
                  steps: int = STEPS) -> float | None:
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(replicas * ranks), str(REPO / "bench" / "scripts" /
                                                          f"{example}_baseline.py"),
            "--ranks", str(ranks), "--steps", str(steps), "-M", "8", "--compute-ms", "20"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("{")), None)
    if done.returncode != 0 or line is None:
        print(f"  torch {example} {replicas}x{ranks} failed: {done.stderr.strip()[-300:]}",
              flush=True)
        return None
    return float(json.loads(line)["step_s_median"])


def step_time(summary: dict[str, Any]) -> float:
    """Median time between commits after the first step (warm-up excluded)."""
    times = [t for t in summary["committed_at_s_per_step"] if t is not None]
    return statistics.median(b - a for a, b in zip(times[1:], times[2:], strict=False))


def summarize(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50_s": round(percentile(values, 50), 4),
            "p99_s": round(percentile(values, 99), 4), "max_s": round(max(values), 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--example", choices=("hsdp", "pipeline"), default="hsdp",
                        help="what a replica of several ranks runs: FSDP2 or pipeline stages")
    parser.add_argument("--spanning", action="store_true",
                        help="2x2 and 4x2 with each replica on one agent and spanning K agents")
    parser.add_argument("--exact-cost", action="store_true",
                        help="no kills: 2x2 and 4x2 failure-free in fast and exact mode and "
                             "plain torch's, side by side")
    parser.add_argument("--steps", type=int, default=STEPS,
                        help="steps per job with --exact-cost (default %(default)s; more "
                             "steps, a steadier median)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.exact_cost:
        return exact_cost(args)
    layouts = ([(2, 2, False), (2, 2, True), (4, 2, False), (4, 2, True)] if args.spanning
               else [(2, 1, False), (2, 2, False), (4, 1, False), (4, 2, False)])

    def named(replicas: int, ranks: int, spanning: bool) -> str:
        return f"{replicas}x{ranks}" + ("-spanning" if spanning else "")

    recovered: dict[str, list[float]] = {named(*layout): [] for layout in layouts}
    steps: dict[str, list[float]] = {named(*layout): [] for layout in layouts}
    torch_steps: dict[str, list[float]] = {named(*layout): [] for layout in layouts
                                           if layout[1] > 1 and not args.spanning}
    for round_ in range(args.rounds):
        for replicas, ranks, spanning in layouts:
            name = named(replicas, ranks, spanning)
            print(f"round {round_}: {name}", flush=True)
            killed = run_job(args.out / f"{name}-r{round_}", replicas, ranks,
                             kills(replicas, ranks, round_), args.example, spanning)
            if killed is not None:
                recovered[name] += [f["recovered_s"] for f in killed["failures"]
                                    if f.get("recovered_s")]
            ref = run_job(args.out / f"{name}-ref-r{round_}", replicas, ranks, [], args.example,
                          spanning)
            if ref is not None:
                steps[name].append(step_time(ref))
            if name in torch_steps and \
                    (baseline := baseline_step(replicas, ranks, args.example)) is not None:
                torch_steps[name].append(baseline)
    results: dict[str, Any] = {"environment": environment(), "rounds": args.rounds,
                               "example": args.example, "spanning": args.spanning, "layouts": {}}
    for layout in layouts:
        name = named(*layout)
        torch_step = torch_steps.get(name, [])
        results["layouts"][name] = {
            "recovery": summarize(recovered[name]), "recovered_s": recovered[name],
            "step_s_median": round(statistics.median(steps[name]), 4) if steps[name] else None,
            "step_s": steps[name], "torch_step_s": torch_step,
            "torch_step_s_median": round(statistics.median(torch_step), 4) if torch_step
            else None}
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    torch_name = "torch HSDP" if args.example == "hsdp" else "torch pipeline x DP"
    print(f"| layout | kills | recovery p50 | p99 | max | step, ReCoVer | step, {torch_name} "
          "| ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for name, row in results["layouts"].items():
        rec, ours, theirs = row["recovery"], row["step_s_median"], row["torch_step_s_median"]
        ratio = f"{ours / theirs:.2f}" if ours and theirs else "-"
        print(f"| {name} | {rec['n']} | {rec.get('p50_s', '-')} s | {rec.get('p99_s', '-')} s | "
              f"{rec.get('max_s', '-')} s | {ours} s | {theirs or '-'} s | {ratio} |")
    return 0


def exact_cost(args: argparse.Namespace) -> int:
    """The failure-free step of each sharded layout in fast mode, exact mode and plain torch,
    interleaved within each round (the order rotating), so load drifts hit all three."""
    layouts, modes = [(2, 2), (4, 2)], ["fast", "exact", "torch"]
    steps: dict[str, dict[str, list[float | None]]] = {f"{r}x{k}": {m: [] for m in modes}
                                                       for r, k in layouts}
    for round_ in range(args.rounds):
        for replicas, ranks in layouts:
            name = f"{replicas}x{ranks}"
            for mode in modes[round_ % 3:] + modes[:round_ % 3]:
                print(f"round {round_}: {name} {mode}", flush=True)
                if mode == "torch":
                    step = baseline_step(replicas, ranks, args.example, args.steps)
                else:
                    ref = run_job(args.out / f"{name}-{mode}-r{round_}", replicas, ranks, [],
                                  args.example, reduce=mode, steps=args.steps)
                    step = step_time(ref) if ref is not None else None
                steps[name][mode].append(step)  # None: failed (said above), kept in place
    medians = {name: {m: round(statistics.median(known), 4)
                      if (known := [x for x in v if x is not None]) else None
                      for m, v in by_mode.items()} for name, by_mode in steps.items()}
    # Per round, each ratio of two runs of the same round (None where one failed): their
    # spread says what one round's noise is.
    per_round = {name: {pair: round_ratios(by_mode, *pair.split("/"))
                        for pair in ("exact/fast", "fast/torch", "exact/torch")}
                 for name, by_mode in steps.items()}
    (args.out / "results.json").write_text(json.dumps(
        {"environment": environment(), "rounds": args.rounds, "example": args.example,
         "steps": args.steps, "step_s": steps, "step_s_median": medians,
         "ratio_per_round": per_round}, indent=1))
    print("| layout | fast | exact | torch | exact / fast | fast / torch | exact / torch |")
    print("|---|---|---|---|---|---|---|")
    for name, m in medians.items():
        spread = {pair: spread_of(values) for pair, values in per_round[name].items()}
        print(f"| {name} | {m['fast']} s | {m['exact']} s | {m['torch']} s | "
              f"{ratio(m['exact'], m['fast'])} {spread['exact/fast']} | "
              f"{ratio(m['fast'], m['torch'])} {spread['fast/torch']} | "
              f"{ratio(m['exact'], m['torch'])} {spread['exact/torch']} |")
    return 0


def round_ratios(by_mode: dict[str, list[float | None]], a: str, b: str) -> list[float | None]:
    return [round(x / y, 4) if x and y else None
            for x, y in zip(by_mode[a], by_mode[b], strict=True)]


def spread_of(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    return f"({min(known):.2f}-{max(known):.2f}, median {statistics.median(known):.3f})" \
        if known else ""


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


if __name__ == "__main__":
    sys.exit(main())
