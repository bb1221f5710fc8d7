"""A GPU bucket's reduction over gloo, staged whole vs in pipelined pieces (issue 25 item 3).

Two processes on one host, each with a CUDA buffer, reduce it through the product's
`GenerationGroup` (trainer/groups/gloo.py): staged through pinned host memory in one piece
(each copy waiting for the whole reduction, as before) and in `PIECE_BYTES` pieces whose
copies overlap the reduction of the others (groups/staging.py), alternated round by round,
beside the same allreduce of a host buffer (no copies: the floor). Medians of the rounds.

    python bench/scripts/staging_pipeline.py --mb 25 200        (needs a CUDA device)

Without a GPU, `--cpu` stages host buffers the same way (a check of the script: there are no
device copies to overlap).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.multiprocessing as mp

from recover.trainer.groups import GroupSpec
from recover.trainer.groups.gloo import GenerationGroup, RendezvousServer
from recover.trainer.groups.staging import PIECE_BYTES, HostStaging

WHOLE = 1 << 62


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker(rank: int, port: int, sizes: list[float], rounds: int, cpu: bool,
           results: dict[str, float]) -> None:
    torch.set_num_threads(1)
    device = torch.device("cpu" if cpu else "cuda")
    groups = {}
    for generation, (name, piece_bytes) in enumerate(
            [("staged whole", WHOLE), ("staged in pieces", PIECE_BYTES), ("host buffer", 0)], 1):
        staged = piece_bytes > 0
        group = GenerationGroup(GroupSpec(generation, rank, 2, "127.0.0.1", port, timeout_s=60),
                                staging=HostStaging(piece_bytes) if staged else None,
                                force_staging=cpu and staged)
        group.connect()
        groups[name] = group
    for mb in sizes:
        n = int(mb * 1e6 / 4)
        buffers = {"staged whole": torch.ones(n, device=device),
                   "staged in pieces": torch.ones(n, device=device),
                   "host buffer": torch.ones(n)}
        times: dict[str, list[float]] = {name: [] for name in groups}
        for _ in range(rounds + 1):  # the first round warms up (pinned allocations)
            for name, group in groups.items():
                _sync(device)
                started = time.perf_counter()
                group.allreduce_sum_(buffers[name])
                _sync(device)
                times[name].append(time.perf_counter() - started)
        if rank == 0:
            for name, ts in times.items():
                results[f"{mb:g} MB {name}"] = statistics.median(ts[1:]) * 1000
    for group in groups.values():
        group.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, nargs="+", default=[25.0, 200.0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--cpu", action="store_true", help="no GPU: a check of the script")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("staging_pipeline: no CUDA device (--cpu checks the script only)")
    server = RendezvousServer()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(server.port, args.mb, args.rounds, args.cpu, results), nprocs=2)
        device = "CPU (script check)" if args.cpu else torch.cuda.get_device_name(0)
        print(f"{device}, pieces of {PIECE_BYTES >> 20} MiB, median of {args.rounds} rounds")
        for mb in args.mb:
            whole = results[f"{mb:g} MB staged whole"]
            pieces = results[f"{mb:g} MB staged in pieces"]
            host = results[f"{mb:g} MB host buffer"]
            print(f"{mb:6g} MB: staged whole {whole:7.1f} ms, in pieces {pieces:7.1f} ms "
                  f"(pieces/whole {pieces / whole:.2f}), host buffer {host:7.1f} ms")
    server.close()


if __name__ == "__main__":
    main()
