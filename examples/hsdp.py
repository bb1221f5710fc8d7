"""HSDP under ReCoVer: each replica shards a small causal transformer over its own ranks
with FSDP2.

    recover run --replicas 2 --ranks-per-replica 2 --reduce exact -- python examples/hsdp.py

A replica is `--ranks-per-replica` processes. Each builds the same model from the job's
seed and shards it over `job.replica_mesh` (its replica's ranks only: there is no global
world); ReCoVer splits every microbatch across the ranks, reduces each rank's gradient
shard across replicas, and loses a replica as a unit when any of its ranks dies. The same
script runs unchanged with one rank per replica (it then does not shard). `--save FILE`
writes the final model (gathered from the shards) from the first replica's rank 0.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

import recover.trainer as rt

parser = argparse.ArgumentParser()
parser.add_argument("--microbatch-size", type=int, default=4)
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--width", type=int, default=32)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--save", default="", help="write the final state_dict here")
args = parser.parse_args()

VOCAB, SEQ, HEADS = 64, 32, 4


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.pos = nn.Parameter(0.02 * torch.randn(SEQ, width))
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


job = rt.init()
torch.manual_seed(job.seed)  # the same model and data on every rank of every replica
model = TinyTransformer(args.width, args.layers)
if job.replica_size > 1:
    for block in model.blocks:
        fully_shard(block, mesh=job.replica_mesh)
    fully_shard(model, mesh=job.replica_mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
# A learnable toy language: each token is the previous one plus a small step, mod VOCAB.
steps = torch.randint(1, 4, (4096, SEQ + 1), generator=torch.Generator().manual_seed(7))
corpus = torch.cumsum(steps, dim=1) % VOCAB


def loss_fn(model, batch):
    # `batch` is this rank's slice of the microbatch: count the tokens it holds.
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    return loss, batch[:, 1:].numel()


result = rt.train(job, model, optimizer, loss_fn=loss_fn,
                  microbatches=rt.DatasetMicrobatches(corpus, args.microbatch_size))
if args.save and result.success and result.is_first_replica:
    # Every rank of the replica takes part in gathering the full tensors; rank 0 writes them.
    state = {name: value.full_tensor() if hasattr(value, "full_tensor") else value
             for name, value in model.state_dict().items()}
    if job.replica_rank == 0:
        torch.save(state, args.save)
raise SystemExit(0 if result.success else 1)
