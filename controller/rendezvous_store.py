"""The rendezvous store's own process: a c10d TCPStore on a listening socket it inherits, with
its memory and key count bounded (issue 22 point 5).

c10d's store has no authentication and no limits: a stranger who reaches its port could
write until the host runs out of memory (131 MB in 0.4 s, measured, when it lived in the
controller). Here the kernel bounds it: `RLIMIT_DATA` is set to the memory the process holds
once the store runs plus `--max-mb`, so a write past it fails in the store (the writer's
connection is dropped; the store and its other clients go on, measured with torch 2.13's
libuv store). And because a store full of a stranger's data would refuse the members' keys
too, this process exits once it holds more than half its budget or `--max-keys` keys; its
supervisor (controller/rendezvous.py) starts a fresh one on the same socket. Members lose
nothing they need: a generation's keys matter only while its group is built, and a build
cut by a reset fails like any other and is retried by the next generation.

Protocol with the supervisor, on stdout: one line `ready` once the store serves, and one
line `reset: REASON` before exiting because of a bound.

    python -m recover.controller.rendezvous_store --fd N --max-mb 128 --max-keys 100000
"""

from __future__ import annotations

import argparse
import resource
import socket
import sys
import time
from datetime import timedelta

from recover.common.lifetime import die_with_parent

POLL_S = 0.25
"""How often the store's size is looked at: between two looks a writer can reach the hard
limit at most, which the kernel enforces anyway."""


def data_bytes() -> int:
    """This process's data segment (heap and private writable mappings: what RLIMIT_DATA
    counts), from /proc."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


def over_bound(keys: int, grown: int, max_keys: int, max_bytes: int) -> str | None:
    """Why the store must be reset (None: it may go on). Half the memory budget, so that the
    members' own keys still fit while the supervisor starts a fresh store."""
    if keys > max_keys:
        return f"{keys} keys, more than {max_keys}"
    if grown > max_bytes // 2:
        return f"{grown / 2**20:.0f} MiB written, more than half of its {max_bytes / 2**20:.0f} MiB"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, required=True, help="the listening socket to serve")
    parser.add_argument("--max-mb", type=int, required=True)
    parser.add_argument("--max-keys", type=int, required=True)
    args = parser.parse_args(argv)
    die_with_parent(None)  # the controller's supervisor thread: never outlive it
    listener = socket.socket(fileno=args.fd)
    host, port = listener.getsockname()[:2]
    listener.detach()  # the store owns the descriptor from here on
    from torch.distributed import TCPStore

    store = TCPStore(host, port, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=30), use_libuv=True, master_listen_fd=args.fd)
    max_bytes = args.max_mb << 20
    base = data_bytes()
    resource.setrlimit(resource.RLIMIT_DATA, (base + max_bytes, resource.RLIM_INFINITY))
    print("ready", flush=True)
    while True:
        time.sleep(POLL_S)
        reason = over_bound(store.num_keys(), data_bytes() - base, args.max_keys, max_bytes)
        if reason is not None:
            print(f"reset: {reason}", flush=True)
            return 0


if __name__ == "__main__":
    sys.exit(main())
