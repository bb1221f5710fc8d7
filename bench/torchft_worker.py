"""One replica group of the torchft baseline: `python -m recover.bench.torchft_worker
CONFIG_JSON RANK LIGHTHOUSE STORE_PORT TORCHFT_DIR` (run by `recover.bench.torchft_job`;
torchft is not a dependency of this project and is imported from TORCHFT_DIR, after this
environment's packages, so that torch is this environment's; nothing else imports this).

The job of `recover.bench.ddp_worker` (the same TinyGPT, microbatches, AdamW and split of M
over the replicas, computed with `Workload.compute`, the code ReCoVer's workers run), with
the gradient synchronised through torchft: a `torchft.Manager` per replica group (one
process here, as ReCoVer's replica) joined through the lighthouse, over
`torchft.ProcessGroupGloo`: each step starts the manager's quorum, accumulates the
replica's microbatches locally, allreduces the gradient once (one flat buffer, averaged
over the participants by `Manager.allreduce`), and steps when the manager says the step may
commit. Not `torchft.DistributedDataParallel` (its examples' way): it forces
`find_unused_parameters=True`, a walk of the autograd graph every forward; one flat
allreduce a step is what ReCoVer and DDP's `no_sync` accumulation do, so torchft is measured
at its cheapest. The mean loss of every step equals DDP's and ReCoVer fast's within float
rounding (1.3e-7 in a 10-step check); with torchft's default `init_sync` it did not (the
replicas healing at step 0 add zeros to its gradient). No failures: torchft's failure-free
step.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

from recover.bench.ddp_worker import DDPConfig, compute_share, my_microbatches
from recover.bench.reference_model import ReferenceGPT
from recover.workloads.tinygpt import config as tinygpt


def train(config: DDPConfig, rank: int, lighthouse: str, store_port: int) -> dict[str, list]:
    from torchft import Manager, ProcessGroupGloo  # from the folder main() appended

    torch.set_num_threads(1)  # as ReCoVer's workers and the DDP baseline
    gpt = ReferenceGPT.build(tinygpt.from_command(config.command), config.seed,
                             config.global_microbatches)
    model, inner = gpt.model, gpt.optimizer
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=60)),
        load_state_dict=lambda state: (model.load_state_dict(state["model"]),
                                       inner.load_state_dict(state["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        min_replica_size=config.replicas,  # every step waits for all: no shrinking here
        replica_id=f"replica-{rank}", rank=0, world_size=1, store_addr="127.0.0.1",
        store_port=store_port, lighthouse_addr=lighthouse, hostname="127.0.0.1",
        # Every replica builds the same model from the seed: no healing at step 0 (with it,
        # the replicas that heal contribute zeros to step 0's gradient).
        init_sync=False, timeout=timedelta(seconds=60))
    params = [p for p in model.parameters() if p.requires_grad]
    mine = my_microbatches(rank, config.replicas, config.global_microbatches)
    scale = config.replicas / config.global_microbatches  # torchft averages over replicas

    def forward_backward(module: torch.nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        _, loss = module(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())
        assert loss is not None
        (loss * scale).backward()
        return loss.detach(), gpt.tokens_per_microbatch

    workload = gpt.workload(forward_backward)
    ended_at: list[float] = []
    loss_sums: list[float] = []
    committed: list[bool] = []
    for step in range(config.steps):
        manager.start_quorum()
        inner.zero_grad(set_to_none=False)
        loss_sum = compute_share(workload, step, mine, config.compute_ms)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        manager.allreduce(flat).wait()
        for p, reduced in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.grad.copy_(reduced.view_as(p.grad))
        committed.append(manager.should_commit())
        if committed[-1]:
            inner.step()
        ended_at.append(time.time())
        loss_sums.append(loss_sum)
    manager.shutdown(wait=False)
    return {"ended_at": ended_at, "loss_sums": loss_sums, "committed": committed,
            "participants": manager.num_participants()}


def main() -> int:
    config = DDPConfig(**json.loads(Path(sys.argv[1]).read_text()))
    rank, lighthouse, store_port = int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    sys.path.append(sys.argv[5])
    result = train(config, rank, lighthouse, store_port)
    (Path(config.out_dir) / f"rank-{rank}.json").write_text(json.dumps(result) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as ddp_worker: no C++ static destructors racing gloo's threads


if __name__ == "__main__":
    sys.exit(main())
