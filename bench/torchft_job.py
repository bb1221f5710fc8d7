"""Run the torchft baseline of a job as real processes (`recover bench overhead --torchft`).

torchft 0.2 is not a dependency of this project: it is installed apart, in a folder named by
the caller, which is put after this environment's packages (only torchft is taken from it).
This process hosts torchft's lighthouse and one TCPStore per replica group (its Manager's),
spawns one `recover.bench.torchft_worker` per replica, waits, and merges what the replicas
wrote: the per-step end times (replica 0's clock) and the mean loss over all M microbatches
of each step.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from recover.bench.ddp_job import ddp_config, run_ranks
from recover.bench.ddp_worker import to_json
from recover.proto import pb


def torchft_missing(folder: str) -> str:
    """Why `folder` cannot serve as torchft's install, or "" when it can (pure of imports)."""
    if not (Path(folder) / "torchft" / "__init__.py").is_file():
        return (f"--torchft {folder}: no torchft there (pip install --no-deps --target "
                f"{folder} torchft==0.2.0, and its opentelemetry requirements)")
    return ""


def run_torchft(job: pb.JobConfig, out: Path, folder: str,
                timeout_s: float = 600.0) -> dict[str, Any]:
    """Train `job` with torchft; returns ended_at (per step), loss_per_step, all_committed."""
    if folder not in sys.path:
        sys.path.append(folder)
    from torchft._torchft import LighthouseServer  # the install named by the caller

    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank-*.json"):
        old.unlink()
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=job.replicas)
    stores = [dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                            timeout=timedelta(seconds=60)) for _ in range(job.replicas)]
    config_path = out / "torchft_config.json"
    config_path.write_text(to_json(ddp_config(job, 0, out)) + "\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (os.environ.get("PYTHONPATH", ""), folder) if p))
    try:
        ranks = run_ranks([[sys.executable, "-m", "recover.bench.torchft_worker", str(config_path),
                            str(rank), lighthouse.address(), str(stores[rank].port)]
                           for rank in range(job.replicas)], out, timeout_s, "torchft", env)
    finally:
        lighthouse.shutdown()
        del stores
    losses = [sum(column) / job.global_microbatches
              for column in zip(*(r["loss_sums"] for r in ranks), strict=True)]
    return {"mode": "torchft", "ended_at": ranks[0]["ended_at"], "loss_per_step": losses,
            "all_committed": all(all(r["committed"]) for r in ranks)}
