"""A small ConvNet with BatchNorm: buffers inside the guarantee, an eval on the first replica.

    recover run --replicas 4 --steps 12 --reduce exact -- python examples/batchnorm.py

BatchNorm's running statistics are buffers, written by forward. ReCoVer reduces their
per-microbatch updates like gradients (``buffers="reduce"``, the default): after every step
they are the same whoever computed which microbatch, so in exact mode the eval below gives
the failure-free run's numbers through kills. ``--buffers local`` shows the alternative
(each replica's own buffers, outside the guarantee). ``--eval-out FILE`` appends one JSON
line per step (accuracy, eval loss, a digest of the buffers) from the first replica (one
per rank, with its rank, when the replica is sharded);
``--save FILE`` writes the final model's state_dict there, from the first replica.

With several ranks per replica (``recover run --ranks-per-replica 2 ...``) the model is
sharded with FSDP2 over the replica's ranks; each rank's BatchNorm sees its slice of every
microbatch and ReCoVer commits the mean of the ranks' updates, the same on every rank.
With ``--pipeline`` the ranks are pipeline stages instead (GPipe over the replica's group,
as in examples/pipeline.py): each stage keeps its layers and their BatchNorm statistics,
reduced across replicas with the same stage of the others; the eval line then carries each
stage's buffer digest only (no stage holds the whole model).
"""

import argparse
import hashlib
import json
import os

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import recover.trainer as rt

parser = argparse.ArgumentParser()
parser.add_argument("--width", type=int, default=8)
parser.add_argument("--buffers", choices=["reduce", "local"], default="reduce")
parser.add_argument("--eval-out", default="")
parser.add_argument("--save", default="", help="write the final state_dict here")
parser.add_argument("--pipeline", action="store_true",
                    help="several ranks per replica: pipeline stages instead of FSDP2 shards")
parser.add_argument("--chunks", type=int, default=2, help="pipeline microbatches per microbatch")
args = parser.parse_args()
if args.save and args.pipeline:
    parser.error("--save writes the whole model, which no pipeline stage holds")

job = rt.init()
if job.reduce == "exact" and job.device.type == "cuda":
    # Exact mode recomputes a lost replica's microbatches elsewhere and needs the same bits
    # there: a convolution's backward on a GPU picks nondeterministic kernels otherwise.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
torch.manual_seed(job.seed)  # every replica builds the same model and data

# 8x8 one-channel images of 4 classes: which quadrant holds a bright blob, plus noise.
CLASSES, SIZE, MICROBATCH = 4, 8, 16


def images(count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.randint(0, CLASSES, (count,), generator=generator)
    x = 0.5 * torch.randn(count, 1, SIZE, SIZE, generator=generator)
    for i, label in enumerate(labels.tolist()):
        row, col = divmod(label, 2)
        x[i, 0, row * 4:row * 4 + 4, col * 4:col * 4 + 4] += 1.0
    return x, labels


train_set = torch.utils.data.TensorDataset(*images(2048, torch.Generator().manual_seed(1)))
eval_x, eval_y = (t.to(job.device) for t in images(512, torch.Generator().manual_seed(2)))

width = args.width
layers = [nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
          nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, CLASSES)]
schedule = None
if job.replica_size > 1 and args.pipeline:  # each rank keeps its stage of the layers
    stages, rank = job.replica_size, job.replica_rank
    bounds = [round(i * len(layers) / stages) for i in range(stages + 1)]
    model = nn.Sequential(*layers[bounds[rank]:bounds[rank + 1]]).to(job.device)
    # The stage's input and output shapes given up front: left to infer them, the stage
    # runs an extra forward on its first step, which moves the BatchNorm statistics (the
    # determinism check then stops the job). Found in eval mode, which leaves them alone.
    example = torch.zeros(MICROBATCH // args.chunks, 1, SIZE, SIZE, device=job.device)
    with torch.no_grad():
        for layer in layers[:bounds[rank]]:
            example = layer.to(job.device).eval()(example)
        output = model.eval()(example)
    model.train()
    schedule = ScheduleGPipe(
        PipelineStage(model, rank, stages, job.device, input_args=example, output_args=output,
                      input_grads=torch.zeros_like(example) if rank > 0 else None,
                      output_grads=torch.zeros_like(output) if rank < stages - 1 else None,
                      group=job.replica_group),
        n_microbatches=args.chunks, scale_grads=False,
        loss_fn=lambda logits, y: nn.functional.cross_entropy(logits, y) / args.chunks)
else:
    model = nn.Sequential(*layers).to(job.device)
    if job.replica_size > 1:  # HSDP: shard inside the replica, ReCoVer replicates across
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=job.replica_mesh)
        fully_shard(model, mesh=job.replica_mesh)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def loss_fn(model, batch):
    x, y = (t.to(job.device) for t in batch)
    return nn.functional.cross_entropy(model(x), y)


def forward_backward(model, batch):
    """Pipeline stages: the schedule over the whole microbatch; the last stage has the loss."""
    x, y = (t.to(job.device) for t in batch)
    if job.replica_rank == 0:
        schedule.step(x)
    elif job.replica_rank == job.replica_size - 1:
        losses: list[torch.Tensor] = []
        schedule.step(target=y, losses=losses)
        return float(torch.stack(losses).sum())
    else:
        schedule.step()
    return 0.0  # the replica's loss is the sum of its stages'


def buffers_digest() -> str:
    buffers = hashlib.sha256()
    for name, tensor in model.named_buffers():
        buffers.update(name.encode() + tensor.cpu().numpy().tobytes())
    return buffers.hexdigest()


def evaluate(info: rt.StepInfo) -> None:
    """On the first replica only: eval mode uses (and leaves) the running statistics."""
    if not info.is_first_replica:
        return
    if schedule is not None:  # a stage cannot evaluate the model alone: its buffers only
        if args.eval_out:
            with open(args.eval_out, "a") as out:
                out.write(json.dumps({"step": info.step, "rank": job.replica_rank,
                                      "buffers_sha256": buffers_digest()}) + "\n")
        return
    import time as _t
    _a, _c = _t.perf_counter(), _t.thread_time()
    model.eval()  # sharded: every rank of the replica runs it (FSDP gathers the parameters)
    with torch.no_grad():
        logits = model(eval_x)
    model.train()
    _b, _d = _t.perf_counter(), _t.thread_time()
    with open("/tmp/evt-" + args.buffers, "a") as _f:
        _f.write(f"{info.step} {(_b - _a) * 1000:.2f} {(_d - _c) * 1000:.2f}\n")
    line = {"step": info.step, "accuracy": float((logits.argmax(1) == eval_y).float().mean()),
            "eval_loss": float(nn.functional.cross_entropy(logits, eval_y)),
            "buffers_sha256": buffers_digest()}
    if job.replica_size > 1:  # a line from every rank: their buffers must be the same
        line["rank"] = job.replica_rank
    if info.step == job.steps - 1 and job.replica_rank == 0:
        print(f"step {info.step}: eval accuracy {line['accuracy']:.3f}", flush=True)
    if args.eval_out:
        with open(args.eval_out, "a") as out:
            out.write(json.dumps(line) + "\n")


pieces = {"forward_backward": forward_backward} if schedule is not None else {"loss_fn": loss_fn}
result = rt.train(job, model, optimizer,
                  microbatches=rt.DatasetMicrobatches(train_set, microbatch_size=MICROBATCH),
                  on_step_committed=evaluate, buffers=args.buffers, **pieces)
if args.save and result.success and result.is_first_replica:  # exactly one replica saves
    # Sharded: every rank of the replica gathers (a collective), rank 0 writes.
    state = {name: value.full_tensor() if hasattr(value, "full_tensor") else value
             for name, value in model.state_dict().items()}
    if job.replica_rank == 0:
        torch.save(state, args.save)
raise SystemExit(0 if result.success else 1)
