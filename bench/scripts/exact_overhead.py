"""Exact vs fast reduction: failure-free step time, side by side in one run.

    python bench/scripts/exact_overhead.py --out /tmp/bench-exact [--reps 2]

For two model sizes — the demo's (~106k parameters, 4 replicas, M=16, B=8)
and a ~9.5M-parameter GPT (3 layers, width 512; 2 replicas, M=8, B=8) — it
runs `recover run` failure-free with `--reduce fast` and `--reduce exact`,
alternating the modes `reps` times so drifting machine load hits both, and
reports the median step time of each mode and their ratio. It also times the
exact path's per-microbatch quantization alone (no processes) for each size,
which is where exact spends its extra time besides an allreduce of float64
(2x the bytes of float32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from recover.bench.env import git_revision, machine

SIZES: dict[str, dict[str, Any]] = {
    "demo (106k params)": {"args": ["--replicas", "4", "-M", "16", "-B", "8", "--steps", "25"],
                           "layers": 2, "width": 64},
    "~9.5M params": {"args": ["--replicas", "2", "-M", "8", "-B", "8", "--steps", "8",
                              "--n-layer", "3", "--n-embd", "512", "--n-head", "8"],
                     "layers": 3, "width": 512},
}


def run_job(out: Path, args: list[str], mode: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "recover.cli.main", "run", *args, "--reduce", mode, "--quiet",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr[-500:]}")
    return json.loads((out / "summary.json").read_text())


def quantize_cost_ms(layers: int, width: int, repeats: int = 5) -> tuple[int, float]:
    """Per-microbatch time of ExactAccumulator.after_microbatch on a model of this shape."""
    import torch

    from recover.trainer.gradients import GradientBuckets
    from recover.trainer.reduction import ExactAccumulator
    from recover.workloads.tinygpt.model import GPTConfig, build_model

    torch.set_num_threads(1)
    model = build_model(GPTConfig(n_layer=layers, n_embd=width, n_head=8 if width >= 512 else 4),
                        init_seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = GradientBuckets(params)
    for bucket in grads.buckets:  # one bucket here: a float32 model on the CPU
        bucket.flat.normal_(std=1e-3)
    accumulator = ExactAccumulator(grads, 16)
    accumulator.after_microbatch(1.0)
    started = time.perf_counter()
    for _ in range(repeats):
        accumulator.after_microbatch(1.0)
    numel = sum(bucket.numel for bucket in grads.buckets)
    return numel, (time.perf_counter() - started) / repeats * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"machine": machine(), "revision": git_revision(),
                               "date": time.strftime("%Y-%m-%d"), "sizes": {}}
    for name, size in SIZES.items():
        steps: dict[str, list[float]] = {"fast": [], "exact": []}
        breakdown: dict[str, dict[str, float]] = {}
        for rep in range(args.reps):
            for mode in ("fast", "exact"):
                summary = run_job(out / f"{name.split()[0]}-{mode}-{rep}", size["args"], mode)
                steps[mode].append(summary["step_time"]["median_s"])
                breakdown[mode] = summary["step_time"]
                print(f"{name}: {mode} rep {rep}: step {summary['step_time']['median_s'] * 1000:.1f} ms",
                      file=sys.stderr, flush=True)
        fast, exact = statistics.median(steps["fast"]), statistics.median(steps["exact"])
        params, quantize_ms = quantize_cost_ms(size["layers"], size["width"])
        results["sizes"][name] = {
            "params": params, "fast_step_s": fast, "exact_step_s": exact,
            "overhead": exact / fast - 1, "runs": steps, "last_breakdown": breakdown,
            "quantize_ms_per_microbatch": quantize_ms,
        }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"{'model':<22} {'params':>10} {'fast step':>10} {'exact step':>11} {'overhead':>9} "
          f"{'quantize/mb':>12}")
    for name, r in results["sizes"].items():
        print(f"{name:<22} {r['params']:>10,} {r['fast_step_s'] * 1000:>8.1f}ms "
              f"{r['exact_step_s'] * 1000:>9.1f}ms {r['overhead'] * 100:>8.1f}% "
              f"{r['quantize_ms_per_microbatch']:>10.2f}ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
