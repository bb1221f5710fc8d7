"""Plain torch, no ReCoVer: N processes create a c10d TCPStore client at the same instant
and then a gloo group over it, as every survivor does at a rebuild (BENCHMARKS 3c).

Found with it: at 32 clients about half take 5.0 s (sometimes 10.0 s) to create their store
client, at 8-24 clients none does; plain TCP connects and getaddrinfo calls in the same
burst (IPv4 or IPv6 sockets) take milliseconds. So the 5 s rebuilds at 32 replicas are the
store client's, not ReCoVer's code: its reverse lookups of `::ffff:127.0.0.1`. `--listener
ipv4` hands c10d an IPv4 listening socket instead (no stall, but gloo's build then failed in
some bursts); with that address in /etc/hosts, `c10d` and `ipv6` stall in none.

    python bench/scripts/store_connect_burst.py --clients 32 [--old-backend] [--listener ipv4]
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import time
from typing import Any


def member(rank: int, clients: int, port: int, start_at: float, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    time.sleep(max(0.0, start_at - time.time()))
    began = time.time()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    connected = time.time() - began
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = datetime.timedelta(seconds=60)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    dist.ProcessGroupGloo(dist.PrefixStore("g", store), rank, clients, options)
    results.put((connected, time.time() - began))
    time.sleep(10.0)  # the others may still be building over this process's listener


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--old-backend", action="store_true", help="the non-libuv store")
    parser.add_argument("--listener", choices=["c10d", "ipv4", "ipv6"], default="c10d",
                        help="who opens the store's listening socket: c10d (dual-stack IPv6), "
                             "or this script (master_listen_fd), IPv4 or dual-stack IPv6")
    args = parser.parse_args()
    import socket

    import torch.distributed as dist

    listener = None
    if args.listener != "c10d":
        v4 = args.listener == "ipv4"
        listener = socket.socket(socket.AF_INET if v4 else socket.AF_INET6, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1" if v4 else "::", 0))
        listener.listen(128)
    master = dist.TCPStore("127.0.0.1", listener.getsockname()[1] if listener else 0,
                           is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=60),
                           use_libuv=not args.old_backend,
                           master_listen_fd=listener.fileno() if listener else None)
    results: Any = mp.Queue()
    start_at = time.time() + 6.0  # every process started and idle by then
    processes = [mp.Process(target=member, args=(r, args.clients, master.port, start_at,
                                                 results)) for r in range(args.clients)]
    for process in processes:
        process.start()
    times = [results.get(timeout=120) for _ in processes]
    store_s = sorted(t[0] for t in times)
    print(f"{args.clients} clients: store client max {store_s[-1]:.3f} s, "
          f"{sum(t > 1.0 for t in store_s)} over 1 s; store + gloo group max "
          f"{max(t[1] for t in times):.3f} s")
    for process in processes:
        process.join(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
