"""Plain torch DDP on the model and job of bench/scripts/gpu_exact_cost.sh, for a side by
side step time: `examples/hsdp.py`'s transformer (--width/--layers), M microbatches per step
split over the ranks (gradient accumulation under no_sync, one allreduce per step, as
ReCoVer's fast mode), AdamW, on each rank's GPU (or the CPU). Backend gloo by default: on
one GPU two ranks cannot share NCCL, and ReCoVer's cross-replica group is gloo too.

    torchrun --nproc_per_node 2 bench/scripts/ddp_gpu_baseline.py --width 1024 --layers 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from toy_transformer import TinyTransformer, corpus, cross_entropy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("-M", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--compute-ms", type=float, default=0.0,
                        help="sleep this long after each microbatch's backward, as ReCoVer's "
                             "--compute-ms (emulated accelerator time)")
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    torch.manual_seed(1)
    model = TinyTransformer(args.width, args.layers).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = corpus()
    per_rank = args.M // world
    ends = []
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        for i in range(per_rank):
            start = ((step * args.M + rank * per_rank + i) * args.microbatch_size) % len(data)
            batch = data[start:start + args.microbatch_size].to(device)
            context = ddp.no_sync() if i < per_rank - 1 else torch.enable_grad()
            with context:
                loss = cross_entropy(ddp(batch[:, :-1]), batch[:, 1:]) / args.M
                loss.backward()
            if args.compute_ms:
                time.sleep(args.compute_ms / 1000)
        optimizer.step()
        if cuda:
            torch.cuda.synchronize(device)
        ends.append(time.perf_counter())
    step_s = statistics.median(b - a for a, b in zip(ends[2:], ends[3:], strict=False))
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"ddp ({args.backend}, {world} ranks, {device.type}): {params / 1e6:.1f}M "
              f"parameters, median step {step_s * 1000:.1f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
