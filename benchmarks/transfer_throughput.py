"""Throughput of the join's state transfer stream vs a raw TCP socket, over loopback.

A join ships the donor's whole state as one SNAPSHOT frame (recover.trainer.transfer:
a header, a protobuf StateManifest, then every tensor's raw bytes, received
straight into fresh tensors). This sends the same ~100 float32 tensors
(`--mb` in total, built by recover.trainer.statewire.encode as a donor does)
through `connect` / `Stream.send` to a `Listener` / `Stream.receive` in another
process, and the same number of bytes through a plain socket (`sendall` of
one buffer, `recv_into` a preallocated, already-touched buffer: the best a
socket can do here). A third variant, `raw-fresh`, receives into a buffer
allocated just before (untouched pages, as a joiner's fresh tensors are), to
separate the socket's cost from the first-touch of new memory; and a fourth,
`stream-touched`, is the stream with its receiver's `empty_tensors` swapped
(in the receiver process only) for tensors allocated and touched before the
clock starts: the framing's own cost, without the fresh memory.

Each transfer is timed on the sender, from connect to the receiver's
acknowledgement after its last byte; variants alternate, `--reps` each, and
a fresh receiver process (imports done before the clock starts) serves each.

    python benchmarks/transfer_throughput.py --out benchmarks/results/transfer-throughput
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from recover.bench.env import environment
from recover.proto import pb
from recover.trainer import transfer
from recover.trainer.statewire import EncodedState, as_bytes, decode, encode
from recover.trainer.transfer import FrameKind, Listener, connect

TOKEN = "bench-token"
VARIANTS = ("stream", "raw", "raw-fresh", "stream-touched")
SIZE = struct.Struct("<Q")
EDGE = 4096
"""The receiver checksums the first and last 4 KiB it got, so a run that moved garbage is caught."""


def build_state(total_mb: int, layers: int) -> dict[str, torch.Tensor]:
    """`layers` weight matrices of width 1024 plus as many 1024-wide biases: 2 x layers tensors."""
    floats = total_mb * (1 << 20) // 4
    rows = (floats // layers - 1024) // 1024
    gen = torch.Generator().manual_seed(0)
    state = {}
    for i in range(layers):
        state[f"layer{i}.weight"] = torch.randn(rows, 1024, generator=gen)
        state[f"layer{i}.bias"] = torch.randn(1024, generator=gen)
    return state


def receive(variant: str, nbytes: int, mb: int, layers: int) -> None:
    """Receiver process: announce an address on stdout, take one transfer, ack, print a crc."""
    if variant == "stream-touched":
        ready = [torch.zeros_like(t) for t in build_state(mb, layers).values()]  # touched

        fresh = transfer.empty_tensors

        def touched(metas: Any) -> Iterator[torch.Tensor]:
            metas = list(metas)
            if len(metas) != len(ready):  # the HELLO and END frames: no tensors
                yield from fresh(metas)
                return
            for meta, t in zip(metas, ready, strict=True):
                assert meta.nbytes == t.numel() * t.element_size()
                yield t

        transfer.empty_tensors = touched  # this process only: the module's own reference
    if variant.startswith("stream"):
        listener = Listener("127.0.0.1")
        print(listener.address, flush=True)
        stream, _ = listener.accept(TOKEN, 120)
        kind, manifest, tensors = stream.receive()
        assert kind is FrameKind.SNAPSHOT and isinstance(manifest, pb.StateManifest)
        decode(manifest.root, tensors)  # what a joiner does with it
        stream.send(FrameKind.END, pb.TransferEnd())
        edges = bytes(as_bytes(tensors[0]))[:EDGE] + bytes(as_bytes(tensors[-1]))[-EDGE:]
        stream.close()
    else:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        if variant == "raw":
            buffer.fill_(0)  # touch every page now, outside the timed part
        view = memoryview(buffer.numpy())
        server = socket.create_server(("127.0.0.1", 0))
        print(f"127.0.0.1:{server.getsockname()[1]}", flush=True)
        conn, _ = server.accept()
        header = bytearray(SIZE.size)
        conn.recv_into(header, SIZE.size, socket.MSG_WAITALL)
        assert SIZE.unpack(header)[0] == nbytes
        done = 0
        while done < nbytes:
            got = conn.recv_into(view[done:])
            if got == 0:
                raise SystemExit("sender closed early")
            done += got
        conn.sendall(b"k")
        edges = bytes(view[:EDGE]) + bytes(view[-EDGE:])
        conn.close()
    print(zlib.crc32(edges), flush=True)


def send_once(variant: str, encoded: EncodedState, flat: torch.Tensor, mb: int,
              layers: int) -> tuple[float, bool]:
    """One transfer to a fresh receiver: seconds from connect to ack, and whether the crc matched."""
    nbytes = encoded.nbytes
    proc = subprocess.Popen([sys.executable, __file__, "--receiver", variant, "--nbytes", str(nbytes),
                             "--mb", str(mb), "--layers", str(layers)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    host, _, port = proc.stdout.readline().strip().rpartition(":")
    if variant.startswith("stream"):
        manifest = encoded.manifest()
        started = time.perf_counter()
        stream = connect(f"{host}:{port}", pb.TransferHello(token=TOKEN, donor=0, joiner=1), 30)
        stream.send(FrameKind.SNAPSHOT, manifest, encoded.tensors)
        kind, _, _ = stream.receive()
        elapsed = time.perf_counter() - started
        assert kind is FrameKind.END
        stream.close()
    else:
        started = time.perf_counter()
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(SIZE.pack(nbytes))
        sock.sendall(as_bytes(flat))
        ack = sock.recv(1)
        elapsed = time.perf_counter() - started
        assert ack == b"k"
        sock.close()
    crc = int(proc.stdout.readline())
    proc.wait(timeout=60)
    whole = as_bytes(flat)
    return elapsed, crc == zlib.crc32(bytes(whole[:EDGE]) + bytes(whole[-EDGE:]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--mb", type=int, default=256, help="state size in MiB")
    parser.add_argument("--layers", type=int, default=50, help="2 tensors per layer")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--receiver", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--nbytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receiver:
        receive(args.receiver, args.nbytes, args.mb, args.layers)
        return 0
    if not args.out:
        parser.error("--out is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env_before = environment()
    encoded = encode(build_state(args.mb, args.layers))  # the donor's snapshot copy (not timed)
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in encoded.tensors])
    nbytes = encoded.nbytes
    print(f"{len(encoded.tensors)} tensors, {nbytes / 1e6:.1f} MB, manifest "
          f"{len(encoded.manifest().SerializeToString())} bytes", file=sys.stderr)
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rep in range(args.reps):
        order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[:rep % len(VARIANTS)]  # rotate the first
        for variant in order:
            elapsed, ok = send_once(variant, encoded, flat, args.mb, args.layers)
            if not ok:
                raise SystemExit(f"{variant}: the receiver got different bytes")
            seconds[variant].append(elapsed)
            print(f"rep {rep} {variant:9}: {elapsed * 1000:7.1f} ms, {nbytes / elapsed / 1e6:7.0f} MB/s",
                  file=sys.stderr, flush=True)
    rates = {v: [nbytes / s / 1e6 for s in seconds[v]] for v in VARIANTS}
    med = {v: statistics.median(rates[v]) for v in VARIANTS}
    # Per repetition, stream vs the raw run of the same round (close in time).
    per_rep = [rates["stream"][i] / rates["raw"][i] for i in range(args.reps)]
    result = {
        "benchmark": "transfer_throughput", "bytes": nbytes, "tensors": len(encoded.tensors),
        "reps": args.reps, "seconds": {v: [round(s, 5) for s in seconds[v]] for v in VARIANTS},
        "mb_per_s": {v: {"median": round(med[v], 1), "min": round(min(rates[v]), 1),
                         "max": round(max(rates[v]), 1)} for v in VARIANTS},
        "ratio_stream_vs_raw": round(med["stream"] / med["raw"], 3),
        "ratio_stream_vs_raw_fresh": round(med["stream"] / med["raw-fresh"], 3),
        "ratio_stream_touched_vs_raw": round(med["stream-touched"] / med["raw"], 3),
        "ratio_per_rep": [round(r, 3) for r in per_rep],
        "target_ratio": 0.8, "target_met": med["stream"] / med["raw"] >= 0.8,
        "environment_before": env_before, "environment": environment(), "finished_at": time.time()}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print("\n| variant | MB/s median | min | max |\n|---|---|---|---|")
    for v in VARIANTS:
        print(f"| {v} | {med[v]:.0f} | {min(rates[v]):.0f} | {max(rates[v]):.0f} |")
    print(f"stream / raw = {result['ratio_stream_vs_raw']} (per rep {result['ratio_per_rep']}); "
          f"stream / raw-fresh = {result['ratio_stream_vs_raw_fresh']}; stream-touched / raw = "
          f"{result['ratio_stream_touched_vs_raw']}; target >= 0.8: "
          f"{'met' if result['target_met'] else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
