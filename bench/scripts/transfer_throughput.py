"""Throughput of the join's state transfer vs a raw TCP socket, over loopback.

A join ships the donor's whole state to the joiner (recover.trainer.joining:
`Donation` on the donor, `Catchup` on the joiner, over recover.trainer.transfer).
The state here is shaped like a model trained with Adam: `--layers` weight
matrices and biases (`--mb` / 3 in all) plus two moment tensors of each, as an
optimizer holds them. The joiner has built its model (the weights exist,
touched) but has no optimizer state yet, as a fresh worker.

Variants, alternating, `--reps` each, a fresh receiver process (imports done
before the clock starts) serving each:

- `stream`: the product. The donor copies its snapshot (encode, as a donor
  does between two steps); its `Donation` connects and sends the layout (a PREVIEW frame),
  then the bytes; the joiner's `Catchup` prepares a destination for every
  tensor from the preview (its built model's weights in place, new memory
  touched once for the moments), then receives.
- `stream-tls`: `stream` over TLS 1.3, as when the control plane runs TLS: the joiner's
  listener presents a certificate made for it, the donor pins its digest (issue 22).
- `stream-fresh`: the design before (copy, connect, one SNAPSHOT frame received
  into tensors allocated as it arrives).
- `raw`: the same number of bytes through a plain socket into a buffer touched
  before the clock starts (the best a socket can do here); `raw-fresh`: into a
  buffer allocated just before.

Both processes keep freed memory and run one intra-op thread as workers do
(`trainer/memory.py`, the agent's OMP_NUM_THREADS=1), and the donor computes for 20 ms before
each join's clock starts, as a training donor is busy up to its snapshot (all since
2026-11-28: an idle donor's copy was 2-24 ms instead of ~1 ms, the CPU waking).

Clocks are CLOCK_MONOTONIC, shared by the two processes: the receiver reports
when its last byte landed (and, for `stream`, when its destinations were
ready). `wire` is what the bytes take: for `stream` from the destinations being
ready to the last byte, for `stream-fresh` from the end of the donor's copy
(connect included), for the raw variants from connect. `join` is from the
donor's first action (its copy) to the last byte, everything included;
`prepare` is the joiner's preparation (0 for the others).

`--link-gbit R`: donor and receivers in two network namespaces of their own joined by a
veth pair whose donor side is shaped to R Gbit/s (tc tbf): a join between two hosts over a
link of that speed, each side on its own core (needs root and iproute2).

    python bench/scripts/transfer_throughput.py --out bench/results/transfer-throughput
    python bench/scripts/transfer_throughput.py --variants stream,stream-tls --out ...
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

import torch

from recover.bench.env import environment
from recover.proto import pb
from recover.trainer.destinations import own_tensors
from recover.trainer.joining import Catchup, Donation

try:
    from recover.trainer.memory import keep_freed_memory
except ImportError:  # a build before 2026-11-27 (join_before_after.py runs this on one)
    keep_freed_memory = None  # type: ignore[assignment]
from recover.trainer.statewire import as_bytes, encode
from recover.trainer.transfer import FrameKind, Listener, connect

TOKEN = "bench-token"
VARIANTS = ("stream", "stream-tls", "stream-fresh", "raw", "raw-fresh")
JOINS = ("stream", "stream-tls")
"""The variants that run the product's Donation and Catchup."""
SIZE = struct.Struct("<Q")
SUBNET = "10.213.48"
"""`--link-gbit`: addresses that exist only on the benchmark's veth pair, in its namespaces."""
EDGE = 4096
"""The receiver checksums the first and last 4 KiB of what it got: a run that moved garbage
is caught."""


def build_state(total_mb: int, layers: int, moments: bool = True) -> dict[str, Any]:
    """Weights (`layers` matrices of width 1024 and their biases, a third of `total_mb`) and,
    with `moments`, an optimizer state with two moments of each, like Adam's."""
    floats = total_mb * (1 << 20) // 4 // 3
    rows = (floats // layers - 1024) // 1024
    gen = torch.Generator().manual_seed(0)
    model = {}
    for i in range(layers):
        model[f"layer{i}.weight"] = torch.randn(rows, 1024, generator=gen)
        model[f"layer{i}.bias"] = torch.randn(1024, generator=gen)
    state: dict[int, dict[str, torch.Tensor]] = {}
    if moments:
        state = {i: {"exp_avg": torch.randn_like(t), "exp_avg_sq": torch.rand_like(t)}
                 for i, t in enumerate(model.values())}
    return {"model": model, "optimizer": {"state": state}}


def crc_of(edges: bytes) -> int:
    return zlib.crc32(edges)


def receive(variant: str, nbytes: int, mb: int, layers: int, host: str,
            check_digest: bool = False) -> None:
    """Receiver process: announce an address on stdout, take one transfer, print when its last
    byte landed and a crc of its edges. `check_digest`: then hash the weights received, as a
    joiner does for the controller to check them against the committed digest (on one thread
    here; a joiner hashes on HASH_THREADS, which is 1 on 2 cores and up to 4 on larger hosts,
    so there this overstates the check)."""
    prepared = prepare_s = checked = 0.0
    if check_digest:  # imported as a worker has it, before any join
        from recover.trainer.digest import step_digest
    if variant.startswith("stream"):
        # Builds before issue 22 have no TLS (nor the argument).
        listener = Listener(host, tls=True) if "tls" in variant else Listener(host)
        own = own_tensors(build_state(mb, layers, moments=False)) if variant in JOINS else None
        print(listener.address, getattr(listener, "tls_sha256", ""), flush=True)
        command = pb.Join(joiner=1, donor=0, token=TOKEN, attempt=1)
        cpu_before = time.process_time()
        if own is None:
            stream, _ = listener.accept(TOKEN, 120)
            kind, _, tensors = stream.receive()
            assert kind is FrameKind.SNAPSHOT
            landed = time.monotonic()
            stream.close()
        else:
            catchup = Catchup(listener, command, own=own)
            landed = time.monotonic()
            assert catchup.destinations is not None
            prepared = catchup.destinations.prepared_at
            prepare_s = catchup.destinations.prepare_s
            tensors = list(catchup.state["model"].values()) + [
                m for moments in catchup.state["optimizer"]["state"].values()
                for m in moments.values()]
            if check_digest:
                step_digest(list(catchup.state["model"].items()))
                checked = time.monotonic()
            assert catchup.next() is None
            catchup.close()
        edges = bytes(as_bytes(tensors[0]))[:EDGE] + bytes(as_bytes(tensors[-1]))[-EDGE:]
        cpu = time.process_time() - cpu_before
    else:
        cpu = 0.0
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        if variant == "raw":
            buffer.fill_(0)  # touch every page now, outside the timed part
        view = memoryview(buffer.numpy())
        server = socket.create_server((host, 0))
        print(f"{host}:{server.getsockname()[1]}", flush=True)
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
        landed = time.monotonic()
        edges = bytes(view[:EDGE]) + bytes(view[-EDGE:])
        conn.close()
    print(landed, flush=True)
    print(prepared, flush=True)
    print(prepare_s, flush=True)
    print(crc_of(edges), flush=True)
    print(cpu, flush=True)
    print(checked, flush=True)


def busy(seconds: float) -> None:
    """Compute for `seconds`, as a donor trains right up to its snapshot. Measured: after
    50 ms idle (this process waiting for its receiver) a 2 MB copy took 2-24 ms, the CPU
    waking; busy before, 0.8-1.3 ms (2026-11-28), the same as with a thread started."""
    x = torch.ones(128, 128)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        x @ x


def send_once(variant: str, state: dict[str, Any], flat: torch.Tensor, mb: int,
              layers: int, joiner_netns: str = "", check_digest: bool = False,
              ) -> tuple[dict[str, float], bool]:
    """One transfer to a fresh receiver: its timings, and whether the receiver's crc matched."""
    nbytes = flat.numel()
    where = ["ip", "netns", "exec", joiner_netns] if joiner_netns else []
    host = f"{SUBNET}.2" if joiner_netns else "127.0.0.1"
    proc = subprocess.Popen([*where, sys.executable, __file__, "--receiver", variant, "--nbytes",
                             str(nbytes), "--mb", str(mb), "--layers", str(layers),
                             *(["--check-digest"] if check_digest else []),
                             "--receiver-host", host], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    address, _, pin = proc.stdout.readline().strip().partition(" ")
    host, _, port = address.rpartition(":")
    timings: dict[str, float] = {}
    busy(0.02)
    started = time.monotonic()
    cpu_before = time.process_time()
    if variant in JOINS:
        donate = pb.Donate(donor=0, joiner=1, address=address, token=TOKEN)
        if pin:  # builds before issue 22 have no TLS (nor the field)
            donate.tls_sha256 = pin
        snapshot = encode(state)  # the donor's copy
        copied = time.monotonic()
        donor = Donation(donate, 0, snapshot, 0)
        del snapshot
        donor.finish_before(0)  # no steps to catch up: END follows the snapshot
        donor.done.wait(120)
        if donor.failed:
            print(f"donation failed: {donor.failed}", file=sys.stderr)
        assert not donor.failed, donor.failed
    elif variant == "stream-fresh":
        snapshot = encode(state)
        copied = time.monotonic()
        stream = connect(address, pb.TransferHello(token=TOKEN, donor=0, joiner=1), 30)
        stream.send(FrameKind.SNAPSHOT, snapshot.manifest(), snapshot.tensors)
        stream.close()
    else:
        copied = started
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(SIZE.pack(nbytes))
        sock.sendall(as_bytes(flat))
        sock.close()
    landed = float(proc.stdout.readline())
    prepared = float(proc.stdout.readline())
    prepare_s = float(proc.stdout.readline())
    donor_cpu = time.process_time() - cpu_before
    crc = int(proc.stdout.readline())
    joiner_cpu = float(proc.stdout.readline())
    checked = float(proc.stdout.readline())
    proc.wait(timeout=60)
    # CPU seconds of both ends (every thread; the joiner's from its first wait for a donor):
    # what a join costs the two cores it shares here.
    timings = {"wire": landed - (prepared or copied), "join": landed - started,
               "join_checked": (checked or landed) - started,
               "copy": copied - started, "prepare": prepare_s, "cpu": donor_cpu + joiner_cpu}
    whole = as_bytes(flat)
    return timings, crc == crc_of(bytes(whole[:EDGE]) + bytes(whole[-EDGE:]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--mb", type=int, default=256, help="state size in MiB")
    parser.add_argument("--layers", type=int, default=50, help="2 tensors per layer")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--check-digest", action="store_true",
                        help="the joiner hashes the weights it received (what a joiner does since "
                             "issue 22); `join_checked` includes it")
    parser.add_argument("--link-gbit", type=float,
                        help="between two network namespaces over a veth shaped to this rate")
    parser.add_argument("--receiver", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--nbytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--receiver-host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--joiner-netns", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if keep_freed_memory is not None:
        keep_freed_memory()  # both ends are workers, which keep it (rt.init)
    # One intra-op thread, as a worker's (the agent sets OMP_NUM_THREADS=1). With one per
    # core, the donor's idle OpenMP threads spun after its compute and stalled the join's
    # threads by 4-5 ms at random: most of the demo-size joins' spread (2026-11-28).
    torch.set_num_threads(1)
    if args.receiver:
        receive(args.receiver, args.nbytes, args.mb, args.layers, args.receiver_host,
                args.check_digest)
        return 0
    if not args.out:
        parser.error("--out is required")
    if args.link_gbit and not args.joiner_netns:
        return over_a_link(args.link_gbit)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env_before = environment()
    state = build_state(args.mb, args.layers)  # the donor's live state
    layout = encode(state, check_only=True)
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in layout.tensors])
    nbytes = flat.numel()
    print(f"{len(layout.tensors)} tensors, {nbytes / 1e6:.1f} MB (a third of it the weights), "
          f"manifest {len(layout.manifest().SerializeToString())} bytes", file=sys.stderr)
    variants = tuple(v for v in args.variants.split(",") if v)
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}")
    if any("tls" in v for v in variants):
        # The donor is a worker of a TLS job: it has its own TLS listener from its start
        # (which loads `cryptography` and, since 2026-11-28, warms OpenSSL).
        own_listener = Listener("127.0.0.1", tls=True)
        warmed = getattr(own_listener, "warmed", None)
        if warmed is not None:
            warmed.wait(10)
    timings: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for rep in range(args.reps):
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]  # rotate the first
        for variant in order:
            timing, ok = send_once(variant, state, flat, args.mb, args.layers, args.joiner_netns,
                                   args.check_digest)
            if not ok:
                raise SystemExit(f"{variant}: the receiver got different bytes")
            timings[variant].append(timing)
            print(f"rep {rep} {variant:12}: wire {timing['wire'] * 1000:7.1f} ms "
                  f"({nbytes / timing['wire'] / 1e6:5.0f} MB/s), copy {timing['copy'] * 1000:6.1f} "
                  f"ms, prepare {timing['prepare'] * 1000:6.1f} ms, join "
                  f"{timing['join'] * 1000:7.1f} ms", file=sys.stderr, flush=True)

    def rates(variant: str, key: str) -> list[float]:
        return [nbytes / t[key] / 1e6 for t in timings[variant]]

    def ratio(a: str, b: str, of: dict[str, float]) -> float | None:
        return round(of[a] / of[b], 3) if a in of and b in of else None

    med = {v: statistics.median(rates(v, "wire")) for v in variants}
    join_s = {v: statistics.median(t["join"] for t in timings[v]) for v in variants}
    copy_s = {v: statistics.median(t["copy"] for t in timings[v]) for v in variants
              if v.startswith("stream")}
    prepare_s = {v: statistics.median(t["prepare"] for t in timings[v]) for v in variants
                 if v in JOINS}
    cpu_s = {v: statistics.median(t["cpu"] for t in timings[v]) for v in prepare_s}
    per_rep = ([round(s / r, 3) for s, r in zip(rates("stream", "wire"), rates("raw", "wire"),
                                                 strict=True)]
               if {"stream", "raw"} <= set(variants) else None)
    tls_per_rep = ([round(t["join"] / p["join"], 3) for t, p in
                    zip(timings["stream-tls"], timings["stream"], strict=True)]
                   if {"stream", "stream-tls"} <= set(variants) else None)
    stream_vs_raw = ratio("stream", "raw", med)
    tls_join = ratio("stream-tls", "stream", join_s)
    result = {
        "benchmark": "transfer_throughput", "bytes": nbytes, "tensors": len(layout.tensors),
        "reps": args.reps, "variants": list(variants),
        "seconds": {v: [{k: round(x, 5) for k, x in t.items()} for t in timings[v]]
                    for v in variants},
        "wire_mb_per_s": {v: {"median": round(med[v], 1), "min": round(min(rates(v, "wire")), 1),
                              "max": round(max(rates(v, "wire")), 1)} for v in variants},
        "join_s_median": {v: round(join_s[v], 4) for v in variants},
        "join_checked_s_median": {v: round(statistics.median(t["join_checked"] for t in timings[v]), 4)
                                  for v in variants},
        "check_digest": args.check_digest,
        # Which build ran: join_before_after.py checks it (with an editable install, a module
        # missing from an old build is taken from the installed one).
        "joining_module": sys.modules[Donation.__module__].__file__,
        "donor_copy_s_median": {v: round(copy_s[v], 4) for v in copy_s},
        "joiner_prepare_s_median": {v: round(prepare_s[v], 4) for v in prepare_s},
        "donor_plus_joiner_cpu_s_median": {v: round(cpu_s[v], 4) for v in cpu_s},
        "ratio_stream_vs_raw": stream_vs_raw,
        "ratio_stream_fresh_vs_raw": ratio("stream-fresh", "raw", med),
        "ratio_raw_fresh_vs_raw": ratio("raw-fresh", "raw", med),
        "ratio_per_rep": per_rep,
        "join_ratio_stream_vs_stream_fresh": ratio("stream", "stream-fresh", join_s),
        "join_ratio_tls_vs_stream": tls_join, "join_ratio_tls_per_rep": tls_per_rep,
        "target_ratio": 0.8,
        "target_met": None if stream_vs_raw is None else stream_vs_raw >= 0.8,
        "tls_target_ratio": 1.2, "tls_target_met": None if tls_join is None else tls_join <= 1.2,
        "link_gbit": args.link_gbit,
        "environment_before": env_before, "environment": environment(), "finished_at": time.time()}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print("\n| variant | wire MB/s median | min | max | donate -> landed, median |\n|---|---|---|---|---|")
    for v in variants:
        print(f"| {v} | {med[v]:.0f} | {min(rates(v, 'wire')):.0f} | {max(rates(v, 'wire')):.0f} | "
              f"{join_s[v] * 1000:.0f} ms |")
    print(f"stream / raw = {stream_vs_raw} (per rep {per_rep}); whole join stream / "
          f"stream-fresh = {result['join_ratio_stream_vs_stream_fresh']}; tls / stream join = "
          f"{tls_join} (per rep {tls_per_rep}); "
          f"the joiner's preparation {prepare_s} s, CPU of both ends {cpu_s} s (medians)")
    return 0


def over_a_link(gbit: float) -> int:
    """Run this benchmark again as the donor in a namespace of its own, the receivers in
    another, over a veth pair shaped to `gbit` on the donor's side; then remove both."""
    tag = uuid.uuid4().hex[:6]
    donor_ns, joiner_ns, donor_if, joiner_if = (f"rb-d-{tag}", f"rb-j-{tag}", f"vd{tag}",
                                                f"vj{tag}")

    def ip(*argv: str) -> None:
        subprocess.run(["ip", *argv], check=True, capture_output=True, timeout=10)

    try:
        ip("netns", "add", donor_ns)
        ip("netns", "add", joiner_ns)
        ip("link", "add", donor_if, "netns", donor_ns, "type", "veth", "peer", "name", joiner_if,
           "netns", joiner_ns)
        for ns, ifname, host in ((donor_ns, donor_if, 1), (joiner_ns, joiner_if, 2)):
            ip("-n", ns, "addr", "add", f"{SUBNET}.{host}/24", "dev", ifname)
            ip("-n", ns, "link", "set", ifname, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        # A bucket of 10 ms at the rate: a shaper that still passes a whole TSO burst.
        burst = max(int(gbit * 1e9 / 8 * 0.01), 1 << 20)
        subprocess.run(["tc", "-n", donor_ns, "qdisc", "add", "dev", donor_if, "root", "tbf",
                        "rate", f"{gbit}gbit", "burst", str(burst), "latency", "50ms"],
                       check=True, capture_output=True, timeout=10)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        raise SystemExit(f"--link-gbit needs network namespaces (root, iproute2): {exc} "
                         f"{detail.decode(errors='replace').strip()}") from None
    try:
        return subprocess.run(["ip", "netns", "exec", donor_ns, sys.executable, __file__,
                               *sys.argv[1:],
                               "--joiner-netns", joiner_ns], env=os.environ).returncode
    finally:
        for ns in (donor_ns, joiner_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


if __name__ == "__main__":
    sys.exit(main())
