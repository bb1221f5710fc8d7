"""Host memory a worker frees and allocates again every step, kept instead of handed back.

A step allocates large host buffers and frees them: the copies the cross-replica reduction
works on (a collective cut by a failure must leave the accumulation intact), the mean
gradients, the early reduction's buffers. glibc's malloc serves every block above 32 MiB
with a fresh mmap and unmaps it on free, so each step touches every page of them anew:
at 9.5M parameters on the CPU, a 76 MB float64 copy took 25 ms of page faults where the same
copy into memory already touched took 3.4 ms, and a replica's step spent 28 ms (fast) and 76 ms
(exact) in `buffers` + `finish` against 5 and 13 ms with freed blocks kept
(`bench/scripts/exact_parts.py`, BENCHMARKS.md section 4e).

So a worker asks glibc (mallopt) to serve large blocks from its heap (no mmap) and to give
memory back to the system only when more than `TRIM_ABOVE` is free at the heap's top: a
freed buffer is reused by the next step's, pages and all. Why this and not pools of our
own: a buffer is reused only once nothing refers to it any more, which the allocator knows
and our code would have to prove (a donor's queue, a reduction abandoned while gloo may
still write into it). The price: a worker's resident memory stays near its peak (freed
memory goes back only from the heap's top, when more than `TRIM_ABOVE` is free there; the
peak itself is unchanged: measured the same with and without, BENCHMARKS.md 4e), and so
does that of processes it forks (DataLoader workers).

`RECOVER_MALLOC=system` leaves glibc's defaults, and so does any malloc setting of the
user's own (`MALLOC_*_` variables, `GLIBC_TUNABLES`); other C libraries are left as they are.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
"""glibc's mallopt parameters (malloc.h)."""

TRIM_ABOVE = 1 << 30
"""Free memory at the heap's top beyond this goes back to the system; a step's buffers
below it stay."""

OPT_OUT = "RECOVER_MALLOC"


def keep_freed_memory(environ: Mapping[str, str] = os.environ) -> str:
    """Configure this process's malloc as the module says; what was done, for the log."""
    if environ.get(OPT_OUT, "") == "system":
        return f"malloc left at the C library's defaults ({OPT_OUT}=system)"
    own = sorted(k for k in environ if k.startswith("MALLOC_")
                 or (k == "GLIBC_TUNABLES" and "glibc.malloc." in environ[k]))
    if own:
        return f"malloc left as the environment sets it ({', '.join(own)})"
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols, libc's among them (no search)
        mallopt = libc.mallopt
        version = libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return "malloc left as it is (not glibc)"
    version.restype = ctypes.c_char_p
    if not (mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, TRIM_ABOVE)):
        return "malloc left as it is (glibc refused mallopt)"
    return (f"malloc keeps freed blocks for the next step (glibc {version().decode()}: no mmap, "
            f"trimmed above {TRIM_ABOVE >> 20} MiB free)")
