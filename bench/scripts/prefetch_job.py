"""The prefetch benchmark's training script: the minimal example's MLP over a dataset
whose every sample costs `--decode-ms` to produce (decoding, reading: time the trainer's
process would otherwise wait for), loaded in line or ahead by `--loader-workers` threads.
Run by bench/scripts/prefetch.py."""

import argparse
import time

import torch
from torch import nn

import recover.trainer as rt

parser = argparse.ArgumentParser()
parser.add_argument("--decode-ms", type=float, default=5.0)
parser.add_argument("--loader-workers", type=int, default=0)
parser.add_argument("--microbatch-size", type=int, default=16)
args = parser.parse_args()


class Decoded(torch.utils.data.Dataset):
    """4096 samples of a regression task, each `decode_ms` to produce."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(4096, 8, generator=g)
        self.y = torch.sin(self.x.sum(1, keepdim=True))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(args.decode_ms / 1000)  # waiting for the sample, as I/O or a decoder would
        return self.x[i], self.y[i]


job = rt.init()
torch.manual_seed(job.seed)
model = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
result = rt.train(job, model, optimizer, loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
                  microbatches=rt.DatasetMicrobatches(Decoded(), args.microbatch_size,
                                                      num_workers=args.loader_workers))
raise SystemExit(0 if result.success else 1)
