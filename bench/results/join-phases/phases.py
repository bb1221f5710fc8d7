# ruff: noqa: E501  (the patches are the code's own lines)
"""Where a demo-size join's time goes, phase by phase (BENCHMARKS.md section 8).

`patch CLONE` adds timestamp lines (stderr, "T <side> <phase> <CLOCK_MONOTONIC>") to a
clone's transfer code and to its `transfer_throughput.py`; never run it on a working tree.
`show FILE` prints each phase's median time since the donor's clock started, over the joins
in FILE (the benchmark's stderr).

    git clone -q . /tmp/phases && python bench/results/join-phases/phases.py patch /tmp/phases
    cd /tmp/phases && python bench/scripts/transfer_throughput.py --variants stream-tls \\
        --check-digest --reps 15 --mb 2 --layers 4 --out /tmp/tt 2> tls.txt
    python bench/results/join-phases/phases.py show tls.txt
"""

from __future__ import annotations

import statistics
import sys

PATCHES = {
    "trainer/transfer.py": [
        ('''    host, _, port = address.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)''',
         '''    host, _, port = address.rpartition(":")
    import sys as _s; T = lambda m: print("T donor", m, time.monotonic(), file=_s.stderr)  # noqa
    T("connect")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)'''),
        ('''    if not tls_sha256:
        stream = Stream(sock)''', '''    T("tcp")
    if not tls_sha256:
        stream = Stream(sock)'''),
        ('''    stream = Stream(_pinned(sock, address, tls_sha256))
    key = new_key() if seal else b""''', '''    stream = Stream(_pinned(sock, address, tls_sha256))
    T("tls")
    key = new_key() if seal else b""'''),
        ('''        if seal:
            stream.seal(key, donor=True)
    except TransferError:''', '''        T("hello")
        if seal:
            stream.seal(key, donor=True)
        T("sealed")
    except TransferError:'''),
        ('''            conn.settimeout(HELLO_TIMEOUT_S)  # the handshake too: a stranger gets no longer
            if self._tls is not None:''', '''            conn.settimeout(HELLO_TIMEOUT_S)  # the handshake too: a stranger gets no longer
            import sys as _s; T = lambda m: print("T joiner", m, time.monotonic(), file=_s.stderr)  # noqa
            T("accepted")
            if self._tls is not None:'''),
        ('''            stream = Stream(conn)
            try:
                kind, hello, _ = stream.receive(max_message=HELLO_MAX_BYTES, max_tensor_bytes=0)''',
         '''            T("tls")
            stream = Stream(conn)
            try:
                kind, hello, _ = stream.receive(max_message=HELLO_MAX_BYTES, max_tensor_bytes=0)
                T("hello")'''),
        ('''                    stream.seal(hello.stream_key, donor=False)
                    return stream, hello''', '''                    stream.seal(hello.stream_key, donor=False)
                    T("sealed")
                    return stream, hello'''),
    ],
    "trainer/joining.py": [
        ('''            stream.send(FrameKind.PREVIEW, manifest)
            stream.send(FrameKind.SNAPSHOT, manifest, self._snapshot.tensors)''',
         '''            stream.send(FrameKind.PREVIEW, manifest)
            import sys as _s; print("T donor preview", time.monotonic(), file=_s.stderr)  # noqa
            stream.send(FrameKind.SNAPSHOT, manifest, self._snapshot.tensors)
            print("T donor snapshot", time.monotonic(), file=_s.stderr)'''),
        ('''                self.destinations = destinations
                kind, manifest, tensors''', '''                self.destinations = destinations
                import sys as _s; print("T joiner prepared", time.monotonic(), file=_s.stderr)  # noqa
                kind, manifest, tensors'''),
        ('''            self.state: Any = decode(manifest.root, tensors)''',
         '''            import sys as _s; print("T joiner received", time.monotonic(), file=_s.stderr)  # noqa
            self.state: Any = decode(manifest.root, tensors)'''),
    ],
    "bench/scripts/transfer_throughput.py": [
        ('''        snapshot = encode(state)  # the donor's copy
        copied = time.monotonic()''', '''        print("T donor start", started, file=sys.stderr)
        snapshot = encode(state)  # the donor's copy
        copied = time.monotonic()
        print("T donor copied", copied, file=sys.stderr)'''),
        ('''            landed = time.monotonic()
            assert catchup.destinations is not None''', '''            landed = time.monotonic()
            print("T joiner landed", landed, file=sys.stderr)
            assert catchup.destinations is not None'''),
        ('''                step_digest(list(catchup.state["model"].items()))
                checked = time.monotonic()''', '''                step_digest(list(catchup.state["model"].items()))
                checked = time.monotonic()
                print("T joiner checked", checked, file=sys.stderr)'''),
    ],
}


def patch(root: str) -> None:
    for path, pairs in PATCHES.items():
        with open(f"{root}/{path}") as f:
            text = f.read()
        for old, new in pairs:
            if old not in text:
                raise SystemExit(f"{path}: the code changed; update this patch ({old[:50]!r})")
            text = text.replace(old, new)
        with open(f"{root}/{path}", "w") as f:
            f.write(text)


def show(path: str) -> None:
    joins: list[dict[str, float]] = []
    start = 0.0
    with open(path) as f:
        for line in f:
            words = line.split()
            if len(words) != 4 or words[0] != "T":
                continue
            _, side, phase, at = words
            if side == "donor" and phase == "start":
                start = float(at)
                joins.append({})
            elif joins:
                joins[-1][f"{side}.{phase}"] = (float(at) - start) * 1e3
    names = {name for join in joins for name in join}
    median = {n: statistics.median(j[n] for j in joins if n in j) for n in names}
    print(f"{len(joins)} joins; ms since the donor's clock started (medians)")
    for name in sorted(names, key=median.__getitem__):
        print(f"  {name:16s} {median[name]:6.2f}")


if __name__ == "__main__":
    {"patch": patch, "show": show}[sys.argv[1]](sys.argv[2])
