"""Where does a fast-mode reduction's time go on a GPU host, in plain torch.distributed (no
ReCoVer code): one gloo allreduce of host memory vs several concurrent chunks, gloo on the
CUDA tensor itself, and staging (copy to pinned memory, reduce, copy back) whole vs in
pipelined chunks. BENCHMARKS.md section 13 ("Staging in pieces") reads it.

    python bench/scripts/allreduce_shapes_gpu.py 200 25        (MB; needs a CUDA device)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def timed(fn: Callable[[], None], reps: int = 7) -> float:
    """Median milliseconds of `fn`, the ranks lined up by a barrier before each call."""
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    times.sort()
    return times[reps // 2] * 1000


def chunked(buf: torch.Tensor, k: int) -> Callable[[], None]:
    """`buf` reduced as k allreduces in flight together."""
    def run() -> None:
        works = [dist.all_reduce(c, async_op=True) for c in buf.chunk(k)]
        for work in works:
            work.wait()
    return run


def staged_pipelined(dev: torch.Tensor, pinned: torch.Tensor, k: int) -> Callable[[], None]:
    """Each chunk copied to the host and its reduction started before the next chunk is
    copied; each copied back once reduced."""
    def run() -> None:
        works = []
        for d, h in zip(dev.chunk(k), pinned.chunk(k), strict=True):
            h.copy_(d, non_blocking=True)
            torch.cuda.current_stream().synchronize()
            works.append((dist.all_reduce(h, async_op=True), d, h))
        for work, d, h in works:
            work.wait()
            d.copy_(h, non_blocking=True)
    return run


def main(rank: int, n: int, port: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    host = torch.ones(n)
    pinned = torch.ones(n).pin_memory()
    dev = torch.ones(n, device="cuda")
    out = {}
    for k in (1, 2, 4, 8, 16):
        out[f"host allreduce, {k} concurrent chunks"] = timed(chunked(host, k))
    for k in (1, 4, 8):
        out[f"gloo on the CUDA tensor, {k} chunks"] = timed(chunked(dev, k))

    def staged_whole() -> None:
        pinned.copy_(dev, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        dist.all_reduce(pinned)
        dev.copy_(pinned, non_blocking=True)

    out["staged whole"] = timed(staged_whole)
    for k in (4, 8, 16):
        out[f"staged, {k} chunks pipelined"] = timed(staged_pipelined(dev, pinned, k))
    started = time.perf_counter()
    for _ in range(5):
        pinned.copy_(dev)
        torch.cuda.synchronize()
    out["one D2H copy"] = (time.perf_counter() - started) / 5 * 1000
    if rank == 0:
        for key, ms in out.items():
            print(f"{n * 4 / 1e6:.0f} MB  {key:40s} {ms:7.1f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    for mb in sys.argv[1:]:
        mp.spawn(main, args=(int(float(mb) * 1e6 / 4), 29555 + int(float(mb))), nprocs=2)
