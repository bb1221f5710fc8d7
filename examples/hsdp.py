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
import os

import torch
from torch.distributed.fsdp import fully_shard
from toy_transformer import TinyTransformer, corpus, cross_entropy

import recover.trainer as rt

parser = argparse.ArgumentParser()
parser.add_argument("--microbatch-size", type=int, default=4)
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--width", type=int, default=32)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--save", default="", help="write the final state_dict here")
args = parser.parse_args()

job = rt.init()
if job.reduce == "exact" and job.device.type == "cuda":
    # Exact mode recomputes a lost replica's microbatches on another replica and needs the
    # same bits there: on a GPU that takes deterministic kernels (an embedding's backward
    # accumulates with atomics otherwise), and cuBLAS needs a fixed workspace for them.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
torch.manual_seed(job.seed)  # the same model on every rank of every replica
model = TinyTransformer(args.width, args.layers).to(job.device)  # a slot's GPU, or the CPU
if job.replica_size > 1:
    for block in model.blocks:
        fully_shard(block, mesh=job.replica_mesh)
    fully_shard(model, mesh=job.replica_mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)


def loss_fn(model, batch):
    # `batch` is this rank's slice of the microbatch: count the tokens it holds.
    batch = batch.to(job.device)
    return cross_entropy(model(batch[:, :-1]), batch[:, 1:]), batch[:, 1:].numel()


result = rt.train(job, model, optimizer, loss_fn=loss_fn,
                  microbatches=rt.DatasetMicrobatches(corpus(), args.microbatch_size))
if args.save and result.success and result.is_first_replica:
    # Every rank of the replica takes part in gathering the full tensors; rank 0 writes them.
    state = {name: value.full_tensor() if hasattr(value, "full_tensor") else value
             for name, value in model.state_dict().items()}
    if job.replica_rank == 0:
        torch.save(state, args.save)
raise SystemExit(0 if result.success else 1)
