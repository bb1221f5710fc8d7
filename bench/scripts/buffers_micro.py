"""What reducing buffers costs one replica's step, in one process (issue 23's ≤ 2 % target).

`buffers_overhead.py` times whole 2-replica jobs of `examples/batchnorm.py`, whose ~13 ms
steps spread by ±30 % between rounds on 2 shared cores: it cannot resolve 2 %. The buffers'
work is all in each replica's own step: the running statistics restored before every
microbatch's forward and captured after it, packed into the step's reduce buffer with the
gradients, put back at the commit (`trainer/buffers.py`), in exact mode scaled like the
gradients (each microbatch quantized, the next step's scales predicted after the commit) and
hashed into the step digest each member reports (on CPU, at once after the commit); across
replicas they add a few
hundred bytes to the one allreduce the gradients already make (reported below as a share
of its bytes). So this times that step alone: the example's ConvNet (BatchNorm, SGD with
momentum), its microbatches of 16 images, `--microbatches` per step (2: a replica's share
of the job's M = 4 at 2 replicas), through the same `Workload` and accumulator the executor
uses, with `buffers="reduce"` and `buffers="local"`, fast and exact, alternating in blocks of
`--steps` steps, `--rounds` rounds, one intra-op thread.

    python bench/scripts/buffers_micro.py --rounds 15 --out bench/results/buffers-micro
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recover.bench.env import environment
from recover.trainer.buffers import reduced_buckets
from recover.trainer.gradients import GradientBuckets
from recover.trainer.reduction import make_accumulator
from recover.trainer.sources import FunctionMicrobatches
from recover.trainer.workload import Workload

CLASSES, SIZE, BATCH = 4, 8, 16


def convnet(width: int) -> nn.Module:
    """examples/batchnorm.py's model."""
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, CLASSES))


def batch(step: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step * 1000 + microbatch)
    return (torch.randn(BATCH, 1, SIZE, SIZE, generator=gen),
            torch.randint(0, CLASSES, (BATCH,), generator=gen))


def loss_fn(model: nn.Module, data: Any) -> torch.Tensor:
    x, y = data
    return nn.functional.cross_entropy(model(x), y)


class Replica:
    """One replica's step: its microbatches, the reduce buffer, the commit."""

    def __init__(self, mode: str, buffers: str, width: int, microbatches: int,
                 as_job: bool = False) -> None:
        torch.manual_seed(0)
        model = convnet(width)
        self.workload = Workload(model=model, optimizer=torch.optim.SGD(
            model.parameters(), lr=0.1, momentum=0.9), source=FunctionMicrobatches(batch),
            seed=0, loss_fn=loss_fn, buffers=buffers)
        self.workload.source.bind(microbatches, 0)
        self.grads = GradientBuckets(self.workload.params)
        self.acc = make_accumulator(mode, reduced_buckets(self.grads, self.workload.model_buffers),
                                    microbatches)
        self.microbatches, self.step_no = microbatches, 0
        self.reduce_bytes = 0
        self.as_job = as_job
        self.eval_x = torch.randn(512, 1, SIZE, SIZE, generator=torch.Generator().manual_seed(2))

    def step(self) -> None:
        self.acc.reset()
        for mb in range(self.microbatches):
            self.acc.before_microbatch()
            result = self.workload.compute(self.step_no, mb)
            self.grads.repair_views()
            self.acc.after_microbatch(result.loss)
        reduced = self.acc.buffers()  # what the allreduce would carry
        self.reduce_bytes = sum(b.numel() * b.element_size() for b in reduced)
        means = self.acc.finish(reduced).grads
        applied = self.workload.apply(self.grads, means)
        # What the executor's _apply does next: exact mode predicts the next step's scales
        # from the committed mean (the buffers' tensors too).
        self.acc.observe_committed(means)
        self.acc.loss_scale_changed(applied.loss_scale_factor)
        if self.as_job:
            # What the job adds with the example's `on_step_committed`: the digest's tensors
            # copied (the callback may write them), the callback (an eval forward of 512
            # images, on the first replica), the committed buffers put back after it.
            params, buffers = self.workload.digest_tensors()
            copies = [(n, t.detach().clone()) for n, t in params + buffers]
            self.workload.model.eval()
            with torch.no_grad():
                self.workload.model(self.eval_x)
            self.workload.model.train()
            self.workload.restore_buffers()
            del copies
        self.workload.digest()  # every step's proof, the buffers in it too
        self.step_no += 1


def block(replica: Replica, steps: int) -> float:
    """Median step time over `steps` steps."""
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        replica.step()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--as-job", action="store_true",
                        help="add the job's per-step work around the example's on_step_committed "
                             "(the digest's copies, the eval, the buffers put back)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env_before = environment()
    variants = [(mode, buffers) for mode in ("fast", "exact") for buffers in ("local", "reduce")]
    replicas = {v: Replica(*v, args.width, args.microbatches, args.as_job) for v in variants}
    for replica in replicas.values():
        block(replica, 5)  # warm: allocator, first-call paths
    times: dict[str, list[float]] = {f"{m} {b}": [] for m, b in variants}
    for round_ in range(args.rounds):
        for mode, buffers in variants[round_ % 4:] + variants[:round_ % 4]:
            times[f"{mode} {buffers}"].append(block(replicas[(mode, buffers)], args.steps))
        print(f"round {round_}: " + ", ".join(f"{k} {v[-1] * 1000:.2f} ms" for k, v in times.items()),
              file=sys.stderr, flush=True)
    per_round = {mode: [r / loc for r, loc in zip(times[f"{mode} reduce"], times[f"{mode} local"],
                                                  strict=True)] for mode in ("fast", "exact")}
    result = {
        "benchmark": "buffers_micro", "width": args.width, "microbatches": args.microbatches,
        "as_job": args.as_job,
        "steps_per_block": args.steps, "rounds": args.rounds, "seconds": times,
        "median_step_s": {k: statistics.median(v) for k, v in times.items()},
        "ratio_reduce_vs_local": {m: statistics.median(r) for m, r in per_round.items()},
        "ratio_per_round": per_round,
        "reduce_buffer_bytes": {f"{m} {b}": replicas[(m, b)].reduce_bytes for m, b in variants},
        "target": 1.02, "environment_before": env_before, "environment": environment(),
        "finished_at": time.time()}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print("| mode | local | reduce | reduce / local (median of rounds) | reduce buffer local → reduce |\n"
          "|---|---|---|---|---|")
    for mode in ("fast", "exact"):
        local, reduce = (result["median_step_s"][f"{mode} {b}"] for b in ("local", "reduce"))
        size = result["reduce_buffer_bytes"]
        print(f"| {mode} | {local * 1000:.2f} ms | {reduce * 1000:.2f} ms | "
              f"{result['ratio_reduce_vs_local'][mode]:.3f}x | {size[f'{mode} local']} → "
              f"{size[f'{mode} reduce']} bytes |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
