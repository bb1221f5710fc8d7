"""What the plain-torch baselines of `sharded.py` (hsdp_baseline.py, pipeline_baseline.py)
share: their arguments, the world, which rows a microbatch is, and the one line they print."""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist


def arguments(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--ranks", type=int, default=2, help="ranks per replica")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("-M", "--global-microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--compute-ms", type=float, default=20.0,
                        help="emulated accelerator time per microbatch, as --compute-ms")
    return parser


def start() -> tuple[int, int]:
    """One process of the global world (torchrun's environment): (world size, rank)."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    return dist.get_world_size(), dist.get_rank()


def microbatch_rows(data: torch.Tensor, args: argparse.Namespace, step: int, replica: int,
                    per_replica: int, i: int) -> torch.Tensor:
    """The rows of the `i`-th microbatch of `replica` in `step` (as DatasetMicrobatches
    lays out a uniform plan)."""
    microbatch = step * args.global_microbatches + replica * per_replica + i
    start_row = (microbatch * args.microbatch_size) % (len(data) - args.microbatch_size)
    return data[start_row:start_row + args.microbatch_size]


def finish(ends: list[float], rank: int) -> None:
    """Rank 0 prints the median step time after the first step (one JSON line)."""
    if rank == 0:
        gaps = [b - a for a, b in zip(ends[1:], ends[2:], strict=False)]
        print(json.dumps({"step_s_median": statistics.median(gaps), "step_s": gaps}), flush=True)
    dist.destroy_process_group()
