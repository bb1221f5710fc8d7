"""Pipeline stages inside each replica under ReCoVer: a small causal transformer split into
`--ranks-per-replica` stages with torch.distributed.pipelining (GPipe).

    recover run --replicas 2 --ranks-per-replica 2 --reduce exact -- python examples/pipeline.py

Every rank builds the whole model from the job's seed and keeps its own stage; the stages
talk over `job.replica_group` (its replica's ranks only). `forward_backward` runs the
schedule on the whole microbatch, and ReCoVer reduces each stage's gradient across replicas
with the same stage of the others. Only the last stage has the loss: it returns it, the
others return 0 (ReCoVer adds the stages' up). The schedule must not rescale `.grad`
(ReCoVer sums a step's microbatches there): `scale_grads=False`, and the loss is divided by
the pipeline's chunks instead.
"""

import argparse

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from toy_transformer import corpus, cross_entropy, layers

import recover.trainer as rt

parser = argparse.ArgumentParser()
parser.add_argument("--microbatch-size", type=int, default=4)
parser.add_argument("--chunks", type=int, default=2, help="pipeline microbatches per microbatch")
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--width", type=int, default=32)
parser.add_argument("--lr", type=float, default=3e-3)
args = parser.parse_args()

job = rt.init()
torch.manual_seed(job.seed)  # every rank builds the whole model the same way...
whole = layers(args.width, args.layers)
stages = job.replica_size
if len(whole) < stages:
    raise SystemExit(f"pipeline.py: {len(whole)} layers cannot fill {stages} stages")
bounds = [round(i * len(whole) / stages) for i in range(stages + 1)]
first, last = job.replica_rank == 0, job.replica_rank == stages - 1
model = nn.Sequential(*whole[bounds[job.replica_rank]:bounds[job.replica_rank + 1]])  # ...keeps its stage
model.to(job.device)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)


def chunk_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return cross_entropy(logits, targets) / args.chunks


schedule = None
if stages > 1:
    stage = PipelineStage(model, job.replica_rank, stages, job.device,
                          group=job.replica_group)
    schedule = ScheduleGPipe(stage, n_microbatches=args.chunks, loss_fn=chunk_loss,
                             scale_grads=False)


def forward_backward(model, batch):
    batch = batch.to(job.device)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    if schedule is None:  # one rank per replica: the whole model, no pipeline
        loss = cross_entropy(model(inputs), targets)
        loss.backward()
        return loss, targets.numel()
    if first:
        schedule.step(inputs)
    elif last:
        losses: list[torch.Tensor] = []
        schedule.step(target=targets, losses=losses)
        return float(torch.stack(losses).sum()), targets.numel()
    else:
        schedule.step()
    return 0.0, 0  # the loss and the tokens are the last stage's


result = rt.train(job, model, optimizer, forward_backward=forward_backward,
                  microbatches=rt.DatasetMicrobatches(corpus(), args.microbatch_size))
raise SystemExit(0 if result.success else 1)
