"""Plain torch pipeline x data parallelism, the pipeline baseline of `sharded.py`: the same
model, stages, schedule, microbatches and emulated compute as
`recover run --ranks-per-replica K -- python examples/pipeline.py`, over one global world
with no fault tolerance.

One process per rank, started by torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        bench/scripts/pipeline_baseline.py --ranks 2 --steps 10 -M 8 --compute-ms 20

Rank r is stage r mod K of replica r div K: each replica's K ranks run its microbatches
through a GPipe schedule of `--chunks` pipeline microbatches (on a group of their own), M / R
microbatches per step; then each stage sums its gradient over the replicas (one allreduce
of a flat buffer on the group of that stage, as ReCoVer's fast mode makes one per stage),
divides by M and steps. Rank 0 prints one JSON line: the median step time after the first.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch_baseline import arguments, finish, microbatch_rows, start

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from toy_transformer import corpus, cross_entropy, layers  # noqa: E402

parser = arguments(__doc__.splitlines()[0])
parser.add_argument("--chunks", type=int, default=2, help="pipeline microbatches per microbatch")
args = parser.parse_args()
world, rank = start()
stages = args.ranks
replicas = world // stages
replica, stage_index = divmod(rank, stages)
# Every rank creates every group, in the same order (new_group is collective).
pipelines = [dist.new_group(list(range(r * stages, (r + 1) * stages))) for r in range(replicas)]
across = [dist.new_group(list(range(s, world, stages))) for s in range(stages)]
torch.manual_seed(0)
whole = layers(32, 2)
bounds = [round(i * len(whole) / stages) for i in range(stages + 1)]
model = nn.Sequential(*whole[bounds[stage_index]:bounds[stage_index + 1]])
first, last = stage_index == 0, stage_index == stages - 1
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
stage = PipelineStage(model, stage_index, stages, torch.device("cpu"), group=pipelines[replica])
schedule = ScheduleGPipe(stage, n_microbatches=args.chunks, scale_grads=False,
                         loss_fn=lambda logits, targets: cross_entropy(logits, targets) / args.chunks)
params = [p for p in model.parameters() if p.requires_grad]
data = corpus()
per_replica = args.global_microbatches // replicas
ends = []
for step in range(args.steps):
    for i in range(per_replica):
        batch = microbatch_rows(data, args, step, replica, per_replica, i)
        if first:
            schedule.step(batch[:, :-1])
        elif last:
            schedule.step(target=batch[:, 1:], losses=[])
        else:
            schedule.step()
        time.sleep(args.compute_ms / 1000.0)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=across[stage_index])
    flat.div_(args.global_microbatches)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    optimizer.step()
    optimizer.zero_grad()
    dist.barrier()
    ends.append(time.perf_counter())
finish(ends, rank)
