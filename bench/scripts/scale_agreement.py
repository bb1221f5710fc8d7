"""Exact reduction: why the scale is predicted rather than agreed by a MAX-allreduce.

    python bench/scripts/scale_agreement.py --out /tmp/bench-scale [--steps 200]

Agreeing on the scale after the microbatches (a MAX-allreduce of one value
per tensor) costs two things the prediction does not:

1. one more collective per step on the critical path — measured here as the
   latency of a MAX-allreduce of one float per tensor (28 for the demo GPT)
   over 4 gloo ranks on loopback, next to the SUM allreduce of the whole
   gradient the step does anyway;
2. memory: a microbatch can be quantized only once the scale is known, so
   every replica must keep each of its k = M/R microbatch gradients in
   float32 until then (k x 4 bytes x parameters), where prediction
   quantizes each one as it is produced and keeps one float64 accumulator.

The prediction's price is a redo of the step when a gradient outgrows the
predicted scale; the script runs a `--steps`-step exact job and reports how
many redos it needed (`exact_redos`).
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
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recover.bench.env import git_revision, machine

RANKS = 4
TENSORS = 28
PARAMS = 106_240
REPS = 300


def _rank(rank: int, init_file: str, results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=RANKS)
    small = torch.rand(TENSORS)
    grads = torch.rand(PARAMS + 3)
    timings: dict[str, list[float]] = {"max_small": [], "sum_grads": []}
    for _ in range(20):  # warm-up
        dist.all_reduce(small.clone(), op=dist.ReduceOp.MAX)
    for _ in range(REPS):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(small.clone(), op=dist.ReduceOp.MAX)
        timings["max_small"].append(time.perf_counter() - started)
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(grads.clone().double())
        timings["sum_grads"].append(time.perf_counter() - started)
    if rank == 0:
        results.put(timings)
    dist.destroy_process_group()


def collective_latency() -> dict[str, dict[str, float]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_rank, args=(r, init_file, results)) for r in range(RANKS)]
        for p in procs:
            p.start()
        timings = results.get(timeout=300)
        for p in procs:
            p.join(timeout=60)

    def summary(values: list[float]) -> dict[str, float]:
        ordered = sorted(values)
        return {"p50_ms": round(statistics.median(ordered) * 1e3, 3),
                "p99_ms": round(ordered[int(0.99 * (len(ordered) - 1))] * 1e3, 3)}
    return {name: summary(values) for name, values in timings.items()}


def redo_rate(out: Path, steps: int) -> dict[str, Any]:
    run = out / "exact-run"
    cmd = [sys.executable, "-m", "recover.cli.main", "run", "--reduce", "exact", "--replicas", "4",
           "-M", "16", "-B", "8", "--steps", str(steps), "--quiet", "--out", str(run)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"scale_agreement: the exact run failed: {proc.stderr.strip()[-500:]}")
    summary = json.loads((run / "summary.json").read_text())
    return {"steps": summary["steps_committed"], "exact_redos": summary["exact_redos"],
            "step_median_s": summary["step_time"]["median_s"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=200, help="steps of the exact job (default 200)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("timing collectives over 4 gloo ranks ...", file=sys.stderr, flush=True)
    latency = collective_latency()
    print(f"running a {args.steps}-step exact job ...", file=sys.stderr, flush=True)
    redos = redo_rate(out, args.steps)
    per_microbatch_mb = PARAMS * 4 / 2**20
    result = {
        "benchmark": "scale_agreement", "machine": machine(), "git": git_revision(),
        "date": time.strftime("%Y-%m-%d"),
        "max_allreduce_of_scales": latency["max_small"],
        "sum_allreduce_of_gradients_float64": latency["sum_grads"],
        "exact_job": redos,
        "memory_to_defer_quantization": {
            "per_microbatch_MiB_demo": round(per_microbatch_mb, 3),
            "note": "k = M/R float32 gradients per replica; at 7B parameters one is 28 GB",
        },
    }
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"MAX-allreduce of {TENSORS} scales: p50 {latency['max_small']['p50_ms']} ms, "
          f"p99 {latency['max_small']['p99_ms']} ms  (the step's own float64 SUM of "
          f"{PARAMS} values: p50 {latency['sum_grads']['p50_ms']} ms)")
    print(f"exact job: {redos['exact_redos']} redos in {redos['steps']} steps "
          f"(step median {redos['step_median_s'] * 1e3:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
