"""Thin wrapper kept for old command lines: the benchmark is `recover bench recovery`.

    python bench/scripts/recovery.py --out DIR [--runs N] [--replicas R]

is exactly `recover bench recovery --out DIR ...` (recover/bench/recovery.py,
folder bench/). The old `--timeout S` flag is passed on as `--run-timeout S`.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    argv = ["--run-timeout" if a == "--timeout" else a for a in sys.argv[1:]]
    # The command line runs in place of this process rather than being imported: the
    # benchmarks never import `recover.cli` (it imports them), so there is no package cycle.
    os.execv(sys.executable, [sys.executable, "-m", "recover.cli.main", "bench", "recovery", *argv])
