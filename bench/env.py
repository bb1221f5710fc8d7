"""What every benchmark records next to its figures: machine, revision, load, date; percentiles."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy.percentile's default)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def machine() -> dict[str, Any]:
    """Cores, CPU model, Python and torch versions of this machine."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch
        torch_version: str | None = torch.__version__
    except ImportError:
        torch_version = None
    return {"nproc": os.cpu_count(), "cpu_model": cpu, "python": platform.python_version(),
            "torch": torch_version}


def git_revision() -> str | None:
    """HEAD of the checkout being measured, with "+dirty" if it has local changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) or None


FOREIGN_MARKERS = ("recover.cli.main controller", "recover.workloads.tinygpt", "pytest")
"""Command-line fragments of processes that compete with a benchmark for the cores."""


def foreign_load() -> dict[str, Any]:
    """Load average and the other ReCoVer jobs / test runs on this machine right now (noise)."""
    others = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if any(marker in cmd for marker in FOREIGN_MARKERS):
            others += 1
    return {"loadavg_1m": round(os.getloadavg()[0], 2), "other_recover_or_pytest_processes": others}


def environment() -> dict[str, Any]:
    """Machine, torch, git revision (+dirty), UTC date, and the load at this moment."""
    return {**machine(), "revision": git_revision(),
            "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "loadavg_1m": round(os.getloadavg()[0], 2)}
