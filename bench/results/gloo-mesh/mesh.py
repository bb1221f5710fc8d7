"""Plain torch, no ReCoVer: N processes on this machine build a gloo group, with its full mesh
connected at build (gloo's default) or each pair on first use (`lazy_init`, torch 2.13's
`create_device(..., lazy_init=True)`, also TORCH_GLOO_LAZY_INIT=1), then allreduce 4 KB once
and 400 KB once. Each line: the slowest member's build, build -> the first allreduce done,
and the second allreduce alone (a group that needs no building).

    python bench/results/gloo-mesh/mesh.py 4,8,16,32 > bench/results/gloo-mesh/output.txt
"""

import datetime
import multiprocessing as mp
import sys
import time


def worker(rank: int, n: int, port: int, lazy: bool, ready, go, out, prefix: str) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    ready.put(rank)
    go.wait()
    began = time.time()
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=60)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1", lazy_init=lazy)]
    pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, n, opts)
    built = time.time()
    small = torch.ones(1000)
    pg.allreduce([small]).wait()
    assert small[0].item() == n
    first = time.time()
    pg.allreduce([torch.ones(100_000)]).wait()
    out.put((built - began, first - began, time.time() - first))
    time.sleep(0.5)  # every member still there for the others' last reads


def trial(n: int, lazy: bool, port: int) -> tuple[float, float, float]:
    ctx = mp.get_context("spawn")  # not fork: the parent holds the store's threads
    ready, go, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    prefix = f"g{n}-{lazy}-{time.time()}"
    procs = [ctx.Process(target=worker, args=(r, n, port, lazy, ready, go, out, prefix))
             for r in range(n)]
    for proc in procs:
        proc.start()
    for _ in range(n):
        ready.get(timeout=300)
    time.sleep(1)
    go.set()
    results = [out.get(timeout=120) for _ in range(n)]
    for proc in procs:
        proc.join()
    return tuple(max(r[i] for r in results) for i in range(3))  # type: ignore[return-value]


def main() -> None:
    import torch.distributed as dist
    master = dist.TCPStore("127.0.0.1", 0, is_master=True,
                           timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    for n in [int(x) for x in sys.argv[1].split(",")]:
        for _ in range(2):
            for lazy in (False, True):
                built, first, second = trial(n, lazy, master.port)
                print(f"n={n} lazy={lazy}: built {built * 1000:.0f} ms, first allreduce done "
                      f"{first * 1000:.0f} ms, then 400 KB allreduce {second * 1000:.0f} ms",
                      flush=True)


if __name__ == "__main__":
    main()
