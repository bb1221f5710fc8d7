"""A training script as people write them, ported to ReCoVer: mixed precision (bf16
autocast, or fp16 with ReCoVer's loss scaling in a GradScaler's place), `torch.compile`, an
LR schedule and clipping, an evaluation every few steps, TensorBoard logging and a final
save, each on the first replica. README "Porting a training script" walks through it;
`tests/integration/test_porting.py` runs it with kills.

    recover run --replicas 4 --steps 20 --reduce exact -- python examples/porting.py \\
        --tensorboard runs/tb --eval-every 5 --save runs/final.pt

What changed from the plain loop: no `for step in ...`, no `backward()`/`step()`/
`zero_grad()` calls (ReCoVer owns them, on committed steps only), and everything that writes
(logging, evaluation output, the final save) happens where `is_first_replica` is true.
"""

import argparse
import json
import os

import torch
from toy_transformer import TinyTransformer, corpus, cross_entropy

import recover.trainer as rt

parser = argparse.ArgumentParser()
parser.add_argument("--microbatch-size", type=int, default=8)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--amp", choices=["bf16", "fp16", "off"], default="bf16",
                    help="autocast the forward to bfloat16 or float16 (the parameters stay "
                         "float32; fp16 scales the loss)")
parser.add_argument("--init-scale", type=float, default=2.0 ** 16,
                    help="fp16: the first step's loss scale")
parser.add_argument("--compile", choices=["off", "aot_eager", "inductor"], default="off",
                    help="torch.compile backend (inductor needs a C++ compiler on a CPU)")
parser.add_argument("--eval-every", type=int, default=5)
parser.add_argument("--eval-out", default="", help="append one JSON line per evaluation")
parser.add_argument("--tensorboard", default="", help="a TensorBoard log folder")
parser.add_argument("--save", default="", help="write the final state_dict here")
args = parser.parse_args()

job = rt.init()
if job.reduce == "exact" and job.device.type == "cuda":
    # Exact mode recomputes a lost replica's microbatches elsewhere and needs the same bits
    # there: an embedding's backward on a GPU accumulates with atomics otherwise.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
torch.manual_seed(job.seed)  # every replica builds the same model
model = TinyTransformer(width=32, depth=2).to(job.device)  # a slot's GPU, or the CPU
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=5)
# Compile the module ReCoVer computes with; its parameters are the model's own, so the
# optimizer, the gradient buckets and the state ReCoVer sends are unchanged.
forward = model if args.compile == "off" else torch.compile(model, backend=args.compile)
amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
# fp16's range is small: its gradients need the loss scaled up (what GradScaler does in a
# plain loop). ReCoVer owns the step, so it owns the scaling: on the reduced gradient, the
# same steps skipped on every replica.
loss_scale = rt.LossScale(init_scale=args.init_scale) if args.amp == "fp16" else None
data = corpus()
train_set, eval_set = data[:3584], data[3584:]


def loss_fn(model, batch):
    # Autocast around the forward only; the loss is computed in float32. No GradScaler: with
    # fp16, train(loss_scale=...) scales the loss before ReCoVer's backward.
    batch = batch.to(job.device)
    with torch.autocast(job.device.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
        logits = forward(batch[:, :-1])
    return cross_entropy(logits.float(), batch[:, 1:]), batch[:, 1:].numel()


writer = None  # made by whichever replica is first (the first one may be lost mid-run)


def on_step(info: rt.StepInfo) -> None:
    global writer
    if not info.is_first_replica:
        return
    if args.tensorboard and writer is None:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(args.tensorboard)
    if writer is not None:
        writer.add_scalar("train/loss", info.loss, info.step)
        writer.add_scalar("train/lr", info.lr, info.step)
        if info.loss_scale is not None:  # fp16 (info.skipped: the step's gradient overflowed)
            writer.add_scalar("train/loss_scale", info.loss_scale, info.step)
        # Every step: the writer writes from a thread of its own, so a first replica killed
        # before that thread ran loses the step (the one taking over logs from the next).
        writer.flush()
    if (info.step + 1) % args.eval_every:
        return
    model.eval()
    with torch.no_grad(), torch.autocast(job.device.type, dtype=amp or torch.bfloat16,
                                        enabled=amp is not None):
        evaluated = eval_set.to(job.device)
        eval_loss = float(cross_entropy(model(evaluated[:, :-1]).float(), evaluated[:, 1:]))
    model.train()
    if writer is not None:
        writer.add_scalar("eval/loss", eval_loss, info.step)
        writer.flush()
    if args.eval_out:
        with open(args.eval_out, "a") as f:
            f.write(json.dumps({"step": info.step, "eval_loss": eval_loss}) + "\n")


result = rt.train(job, model, optimizer, loss_fn=loss_fn, lr_scheduler=warmup,
                  max_grad_norm=1.0, on_step_committed=on_step, loss_scale=loss_scale,
                  microbatches=rt.DatasetMicrobatches(train_set, args.microbatch_size))
if writer is not None:
    writer.close()
if args.save and result.success and result.is_first_replica:
    torch.save(model.state_dict(), args.save)
raise SystemExit(0 if result.success else 1)
