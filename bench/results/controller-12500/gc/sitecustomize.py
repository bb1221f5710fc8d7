"""A probe of Python's full collections, for any process started with this folder first on
PYTHONPATH: each full collection's duration and what it freed, one file per process in
$GC_PROBE_DIR (default /tmp), named gc-PID.log, its first line the process's command line.

    GC_PROBE_DIR=/tmp/gc PYTHONPATH=bench/results/controller-12500/gc:... recover bench controller ...
"""

import gc
import os
import sys
import time

_started = [0.0]
_out: list = []


def _probe(phase: str, info: dict) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
    elif info["generation"] == 2:
        if not _out:
            folder = os.environ.get("GC_PROBE_DIR", "/tmp")
            _out.append(open(os.path.join(folder, f"gc-{os.getpid()}.log"), "w", buffering=1))  # noqa: SIM115
            _out[0].write(" ".join(sys.argv)[:200] + "\n")
        took = 1000 * (time.perf_counter() - _started[0])
        _out[0].write(f"{time.time():.3f} gen2 {took:.1f}ms collected={info['collected']}\n")


gc.callbacks.append(_probe)
