"""The plain-DDP baseline: `python -m recover.bench.ddp_worker CONFIG_JSON RANK`.

One process per replica, torch.distributed over gloo on a TCPStore the parent
hosts, `DistributedDataParallel` around the same TinyGPT, the same
deterministic microbatches (EpochSampler ids and dropout seeds, built by
bench/reference_model.py as ReCoVer's reference worker builds them), the same
AdamW, the same split of M over replicas as ReCoVer's uniform plan. Gradient
accumulation uses `no_sync()` for all but a rank's last microbatch, so DDP
allreduces once per step, like ReCoVer. No fault tolerance, no controller, no
agent: what users run today.

Each microbatch's loss is scaled by R / M before backward: DDP averages over
the R ranks, so the applied gradient is the mean over all M microbatches —
what ReCoVer applies (it sums and divides by M). Losses are not allreduced
(that would add a collective DDP users do not pay); each rank writes its own
per-step loss sums and the parent adds them up.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from recover.bench.reference_model import ReferenceGPT
from recover.trainer.workload import Workload
from recover.workloads.tinygpt import config as tinygpt


@dataclass(frozen=True)
class DDPConfig:
    """Everything a DDP worker needs; written as JSON by the parent."""

    replicas: int
    """World size: one process per replica."""
    steps: int
    """Optimizer steps to train."""
    global_microbatches: int
    """M: microbatches summed by every step, split over the ranks like ReCoVer's uniform plan."""
    seed: int
    """Seed of init, sample ids and dropout (ReCoVer's --seed)."""
    command: list[str]
    """The job's worker command, `python -m recover.workloads.tinygpt FLAGS`: its flags are
    the model, microbatch size, lr and corpus, parsed as the reference worker parses them."""
    store_port: int
    """Port of the TCPStore the parent hosts on 127.0.0.1."""
    out_dir: str
    """Each rank writes rank-R.json here."""
    compute_ms: float = 0.0
    """Emulated accelerator time slept after each microbatch (ReCoVer's --compute-ms)."""


def my_microbatches(rank: int, replicas: int, global_microbatches: int) -> list[int]:
    """Contiguous near-equal runs, the first M mod R ranks one more (controller's uniform_plan)."""
    base, extra = divmod(global_microbatches, replicas)
    start = rank * base + min(rank, extra)
    return list(range(start, start + base + (1 if rank < extra else 0)))


def compute_share(workload: Workload, step: int, microbatches: list[int], compute_ms: float,
                  before: Callable[[bool], None] = lambda last: None) -> float:
    """A replica's microbatches of `step`, each with ReCoVer's microbatch code and then the
    job's emulated accelerator time; the sum of their losses. `before(last)` runs ahead of
    each (whether it is the replica's last of the step)."""
    loss_sum = 0.0
    for position, microbatch in enumerate(microbatches):
        before(position == len(microbatches) - 1)
        loss_sum += workload.compute(step, microbatch).loss
        if compute_ms > 0:
            time.sleep(compute_ms / 1000.0)
    return loss_sum


def train(config: DDPConfig, rank: int) -> dict[str, list[float]]:
    """Train `config.steps` steps; returns per-step end times and this rank's loss sums."""
    # One intra-op thread, as ReCoVer's workers: same per-process compute, same sharing of cores.
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", config.store_port, config.replicas, is_master=False,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=config.replicas,
                            timeout=timedelta(seconds=60))
    gpt = ReferenceGPT.build(tinygpt.from_command(config.command), config.seed,
                             config.global_microbatches)
    ddp = DistributedDataParallel(gpt.model)
    optimizer = gpt.optimizer
    mine = my_microbatches(rank, config.replicas, config.global_microbatches)
    scale = config.replicas / config.global_microbatches
    last = False

    def forward_backward(model: torch.nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        # no_sync on all but the last microbatch: one allreduce per step, DDP's own.
        with ddp.no_sync() if not last else contextlib.nullcontext():
            _, loss = ddp(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())
            assert loss is not None
            (loss * scale).backward()
        return loss.detach(), gpt.tokens_per_microbatch

    def mark(is_last: bool) -> None:
        nonlocal last
        last = is_last

    # ReCoVer's own microbatch code (sample order, dropout seeds), DDP's backward.
    workload = gpt.workload(forward_backward)
    ended_at: list[float] = []
    loss_sums: list[float] = []
    for step in range(config.steps):
        optimizer.zero_grad(set_to_none=False)
        loss_sum = compute_share(workload, step, mine, config.compute_ms, mark)
        optimizer.step()
        ended_at.append(time.time())
        loss_sums.append(loss_sum)
    dist.destroy_process_group()
    return {"ended_at": ended_at, "loss_sums": loss_sums}


def main() -> int:
    config = DDPConfig(**json.loads(Path(sys.argv[1]).read_text()))
    rank = int(sys.argv[2])
    result = train(config, rank)
    (Path(config.out_dir) / f"rank-{rank}.json").write_text(json.dumps(result) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip C++ static destructors: gloo/TCPStore threads racing them at interpreter exit
    # sometimes abort ("terminate called without an active exception", seen 1 in ~4 runs)
    # after the results are already written.
    os._exit(0)


def to_json(config: DDPConfig) -> str:
    return json.dumps(asdict(config))


if __name__ == "__main__":
    sys.exit(main())
