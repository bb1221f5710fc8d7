"""The whole ReCoVer API at a glance: an MLP on a synthetic regression set.

    recover run --replicas 4 --steps 30 -- python examples/minimal.py --hidden 32
"""

import argparse

import torch
from torch import nn

import recover.trainer as rt

parser = argparse.ArgumentParser()
parser.add_argument("--hidden", type=int, default=32)
parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
parser.add_argument("--loader-workers", type=int, default=0,
                    help="load the planned microbatches ahead on this many threads")
args = parser.parse_args()
dtype = getattr(torch, args.dtype)

job = rt.init()  # attach to this host's agent; the job's seed, M, steps, reduction
torch.manual_seed(job.seed)  # every replica builds the same model and data

# 4096 samples of y = sin(x @ w) + noise: a dataset is anything with len() and [i].
x = torch.randn(4096, 8)
y = torch.sin(x @ torch.randn(8, 1)) + 0.05 * torch.randn(4096, 1)
dataset = torch.utils.data.TensorDataset(x.to(dtype), y.to(dtype))

model = nn.Sequential(nn.Linear(8, args.hidden), nn.GELU(), nn.Dropout(0.1),
                      nn.Linear(args.hidden, 1)).to(dtype)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=job.steps)


def loss_fn(model, batch):
    inputs, targets = batch
    return nn.functional.mse_loss(model(inputs), targets)


def log(info: rt.StepInfo) -> None:
    if info.is_first_replica and info.step % 10 == 0:
        print(f"step {info.step}: loss {info.loss:.4f} lr {info.lr:.2e} norm {info.grad_norm:.3f}")


result = rt.train(job, model, optimizer,
                  microbatches=rt.DatasetMicrobatches(dataset, microbatch_size=16,
                                                      num_workers=args.loader_workers),
                  loss_fn=loss_fn, lr_scheduler=schedule, max_grad_norm=1.0,
                  on_step_committed=log)
raise SystemExit(0 if result.success else 1)
