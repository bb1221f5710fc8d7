"""Thin wrapper kept for old command lines: the benchmark is `recover bench recovery`.

    python benchmarks/recovery.py --out DIR [--runs N] [--replicas R]

is exactly `recover bench recovery --out DIR ...` (recover/bench/recovery.py,
folder bench/). The old `--timeout S` flag is passed on as `--run-timeout S`.
"""

from __future__ import annotations

import sys

from recover.cli.main import main

if __name__ == "__main__":
    argv = ["--run-timeout" if a == "--timeout" else a for a in sys.argv[1:]]
    sys.exit(main(["bench", "recovery", *argv]))
