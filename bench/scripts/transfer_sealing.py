"""The transfer connection alone: plain TCP, TLS records, and sealed records (issue 22).

`transfer_throughput.py` times whole joins, whose donor copy and joiner preparation
(page faults, on this VM ±50 ms between rounds) swamp what the cipher costs. Here one
frame of `--tensors` float32 tensors (`--mb` in all) goes from a forked donor process to
this process over loopback through `recover.trainer.transfer` (`connect` → `Stream.send`,
`Listener.accept` → `Stream.receive` into memory touched beforehand), in three ways,
alternating, `--reps` rounds:

- `plain`: no TLS (a control plane without TLS);
- `tls`: TLS 1.3 records all the way (`connect(..., seal=False)`: what small states use);
- `sealed`: TLS for the handshake and the keyed hello, then AES-GCM records
  (`seal=True`: what a state of at least `joining.SEAL_FROM_BYTES` uses).

Reported per way: the receive's wall time (first byte asked to last byte in), the CPU
seconds of each end for the frame (connect excluded), and the donor's `connect` (TCP, the
TLS handshake, the hello and, sealed, TLS's close both ways), medians over rounds.

    python bench/scripts/transfer_sealing.py --reps 15 --out bench/results/transfer-sealing
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from recover.bench.env import environment
from recover.proto import pb
from recover.trainer.statewire import tensor_metas
from recover.trainer.transfer import FrameKind, Listener, connect

WAYS = ("plain", "tls", "sealed")


def once(way: str, tensors: list[torch.Tensor]) -> dict[str, float]:
    listener = Listener("127.0.0.1", tls=way != "plain")
    pin = listener.tls_sha256
    read_end, write_end = os.pipe()
    go_read, go_write = os.pipe()  # the donor connects once the joiner is ready to accept
    pid = os.fork()
    if pid == 0:  # the donor
        code = 1
        try:
            listener.close()
            os.read(go_read, 1)
            began = time.perf_counter()
            stream = connect(listener.address, pb.TransferHello(token="bench", donor=0, joiner=1),
                             30, tls_sha256=pin, seal=way == "sealed")
            connected = time.perf_counter() - began
            before = time.process_time()
            stream.send(FrameKind.STEP, pb.CatchUpStep(step=1, tensors=tensor_metas(tensors)),
                        tensors)
            os.write(write_end, f"{time.process_time() - before} {connected}".encode())
            stream.close()
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    # Touched now, after the fork (memory shared with the donor would fault on every write):
    # the joiner's prepared memory.
    into = [torch.zeros_like(t) for t in tensors]
    os.write(go_write, b"g")
    stream, _ = listener.accept("bench", 30)
    cpu, wall = time.process_time(), time.perf_counter()
    kind, _, got = stream.receive(into=lambda _: into)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    stream.close()
    listener.close()
    donor_cpu, connect_s = (float(x) for x in (os.read(read_end, 128) or b"nan nan").split())
    for end in (read_end, go_read, go_write):
        os.close(end)
    _, status = os.waitpid(pid, 0)
    if kind is not FrameKind.STEP or status != 0 or not torch.equal(got[-1], tensors[-1]):
        raise SystemExit(f"{way}: the transfer failed or moved other bytes")
    return {"wall": wall, "joiner_cpu": cpu, "donor_cpu": donor_cpu, "connect": connect_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=300)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env_before = environment()
    rows = max(args.mb * (1 << 20) // 4 // 1024 // args.tensors, 1)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(rows, 1024, generator=gen) for _ in range(args.tensors)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    runs: dict[str, list[dict[str, float]]] = {w: [] for w in WAYS}
    for rep in range(args.reps):
        for way in WAYS[rep % 3:] + WAYS[:rep % 3]:
            result = once(way, tensors)
            runs[way].append(result)
            print(f"rep {rep} {way:6}: {result['wall'] * 1000:6.1f} ms, cpu donor "
                  f"{result['donor_cpu'] * 1000:5.1f} + joiner {result['joiner_cpu'] * 1000:5.1f} ms",
                  file=sys.stderr, flush=True)
    med = {w: {k: statistics.median(r[k] for r in runs[w]) for k in runs[w][0]} for w in WAYS}
    result = {
        "benchmark": "transfer_sealing", "bytes": nbytes, "tensors": args.tensors,
        "reps": args.reps, "seconds": runs, "median": med,
        "wall_vs_plain": {w: round(med[w]["wall"] / med["plain"]["wall"], 3) for w in WAYS},
        "cpu_vs_plain": {w: round((med[w]["donor_cpu"] + med[w]["joiner_cpu"])
                                  / (med["plain"]["donor_cpu"] + med["plain"]["joiner_cpu"]), 3)
                         for w in WAYS},
        "environment_before": env_before, "environment": environment(),
        "finished_at": time.time()}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{nbytes / 1e6:.0f} MB in {args.tensors} tensors, medians of {args.reps} rounds\n"
          "| way | connect | wall | MB/s | CPU donor + joiner | wall / plain | CPU / plain |\n"
          "|---|---|---|---|---|---|---|")
    for w in WAYS:
        m = med[w]
        print(f"| {w} | {m['connect'] * 1000:.2f} ms | {m['wall'] * 1000:.0f} ms | "
              f"{nbytes / m['wall'] / 1e6:.0f} | "
              f"{m['donor_cpu'] * 1000:.0f} + {m['joiner_cpu'] * 1000:.0f} ms | "
              f"{result['wall_vs_plain'][w]:.2f}x | {result['cpu_vs_plain'][w]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
