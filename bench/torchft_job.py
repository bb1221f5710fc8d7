"""Run the torchft baseline of a job as real processes (`recover bench overhead --torchft`).

torchft 0.2 is not a dependency of this project: it is installed apart, in a folder named by
the caller, which this process and the workers put after this environment's packages (only
what the environment lacks, torchft and its opentelemetry, is taken from it). This process
hosts torchft's lighthouse (on loopback) and one TCPStore per replica group (its Manager's),
spawns one `recover.bench.torchft_worker` per replica, waits, and merges what the replicas
wrote: the per-step end times (replica 0's clock) and the mean loss over all M microbatches
of each step.
"""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from recover.bench.ddp_job import ddp_config, run_ranks
from recover.bench.ddp_worker import to_json
from recover.bench.recover_job import JobFailed
from recover.proto import pb

INSTALL = ("pip install --no-deps --target {folder} torchft==0.2.0 and pip install --target "
           "{folder} 'opentelemetry-sdk>=1.39' 'opentelemetry-exporter-otlp-proto-http>=1.39'")


def torchft_missing(folder: str) -> str:
    """Why `folder` cannot serve as torchft's install, or "" when it can: torchft and its
    lighthouse import there, in a child process (a broken install fails there, not here)."""
    if not (Path(folder) / "torchft" / "__init__.py").is_file():
        return f"--torchft {folder}: no torchft there ({INSTALL.format(folder=folder)})"
    probe = subprocess.run(
        [sys.executable, "-c", "import sys; sys.path.append(sys.argv[1]); import torchft; "
         "from torchft._torchft import LighthouseServer", folder],
        capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return f"--torchft {folder}: torchft does not import there: {last}"
    return ""


def run_torchft(job: pb.JobConfig, out: Path, folder: str,
                timeout_s: float = 600.0) -> dict[str, Any]:
    """Train `job` with torchft; returns ended_at (per step), loss_per_step, all_committed."""
    if folder not in sys.path:
        sys.path.append(folder)
    try:
        from torchft._torchft import LighthouseServer  # the install named by the caller
    except ImportError as exc:
        raise JobFailed(f"torchft: does not import from {folder}: {exc}") from None

    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank-*.json"):
        old.unlink()
    try:
        lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=job.replicas)
    except RuntimeError as exc:
        raise JobFailed(f"torchft: its lighthouse did not start: {exc}") from None
    # It names itself by the host's name; the workers reach it where it listens.
    address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    stores: list[dist.TCPStore] = []
    try:
        stores = [dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                                timeout=timedelta(seconds=60)) for _ in range(job.replicas)]
        config_path = out / "torchft_config.json"
        config_path.write_text(to_json(ddp_config(job, 0, out)) + "\n")
        ranks = run_ranks([[sys.executable, "-m", "recover.bench.torchft_worker", str(config_path),
                            str(rank), address, str(stores[rank].port), folder]
                           for rank in range(job.replicas)], out, timeout_s, "torchft")
    finally:
        lighthouse.shutdown()
        del stores
    losses = [sum(column) / job.global_microbatches
              for column in zip(*(r["loss_sums"] for r in ranks), strict=True)]
    return {"mode": "torchft", "ended_at": ranks[0]["ended_at"], "loss_per_step": losses,
            "all_committed": all(all(r["committed"]) for r in ranks)}
