"""Plain torch HSDP, the baseline of `sharded.py`: the same model, microbatches and emulated
compute as `recover run --ranks-per-replica K -- python examples/hsdp.py`, trained by FSDP2
over a 2-D mesh (replicate x shard) of one global world, with no fault tolerance.

One process per rank, started by torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        bench/scripts/hsdp_baseline.py --ranks 2 --steps 10 -M 8 --compute-ms 20

Each replica (a row of the mesh) computes M / R microbatches per step, each split over its
K ranks; gradients are synchronized on the last one (FSDP's reduce-scatter inside the
replica, all-reduce across replicas), then the optimizer steps. Rank 0 prints one JSON
line: the median step time after the first step.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch_baseline import arguments, finish, microbatch_rows, start

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from toy_transformer import TinyTransformer, corpus, cross_entropy  # noqa: E402

args = arguments(__doc__.splitlines()[0]).parse_args()
world, rank = start()
replicas = world // args.ranks
mesh = init_device_mesh("cpu", (replicas, args.ranks), mesh_dim_names=("replicate", "shard"))
replica, shard = divmod(rank, args.ranks)
torch.manual_seed(0)
model = TinyTransformer(32, 2)
for block in model.blocks:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
for module in model.modules():
    if isinstance(module, FSDPModule):
        module.set_force_sum_reduction_for_comms(True)  # gloo has no AVG nor pre-scaled sum
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
data = corpus()
per_replica = args.global_microbatches // replicas
ends = []
for step in range(args.steps):
    for i in range(per_replica):
        batch = microbatch_rows(data, args, step, replica, per_replica, i).chunk(args.ranks)[shard]
        model.set_requires_gradient_sync(i == per_replica - 1)
        cross_entropy(model(batch[:, :-1]), batch[:, 1:]).backward()
        time.sleep(args.compute_ms / 1000.0)
    optimizer.step()
    optimizer.zero_grad()
    dist.barrier()
    ends.append(time.perf_counter())
finish(ends, rank)
