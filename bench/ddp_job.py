"""Run the plain-DDP baseline as real processes and collect what it did.

The parent hosts the TCPStore (so no rank is special and a port is never
guessed), spawns one `recover.bench.ddp_worker` per replica, waits, and
merges the ranks' files: per-step end times (rank 0's clock; every rank
leaves the step's allreduce together) and the mean loss over all M
microbatches of each step.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from recover.bench.ddp_worker import DDPConfig, to_json
from recover.bench.recover_job import JobFailed
from recover.bench.reference import reference_config
from recover.proto import pb


def ddp_config(job: pb.JobConfig, store_port: int, out: Path) -> DDPConfig:
    """The DDP twin of a ReCoVer job: same model, data, M, B, seed, lr, replicas.
    NotReferenceGPT when the job runs a worker command other than the reference GPT."""
    reference_config(job, "the DDP baseline")  # fail here, not in every rank
    return DDPConfig(replicas=job.replicas, steps=job.steps,
                     global_microbatches=job.global_microbatches, seed=job.seed,
                     command=list(job.workload.command), store_port=store_port,
                     out_dir=str(out), compute_ms=job.testing.compute_ms)


def run_ranks(commands: list[list[str]], out: Path, timeout_s: float, label: str,
              env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Start one process per command (rank r logs to out/rank-r.log), wait for all within
    `timeout_s`, and return what each wrote to out/rank-r.json; JobFailed naming the first
    rank that failed (its last log line) or the time limit. Nothing is left running."""
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for rank, command in enumerate(commands):
            log = open(out / f"rank-{rank}.log", "wb")  # noqa: SIM115 (closed below)
            logs.append(log)
            procs.append(subprocess.Popen(command, env=env, stdout=log,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        raise JobFailed(f"{label}: no result within {timeout_s:.0f}s") from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    bad = [(rank, p.returncode) for rank, p in enumerate(procs) if p.returncode != 0]
    if bad:
        rank, code = bad[0]
        tail = (out / f"rank-{rank}.log").read_text(errors="replace").strip().splitlines()[-1:]
        raise JobFailed(f"{label}: rank {rank} exited with {code}: {' '.join(tail)}")
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(len(commands))]


def run_ddp(job: pb.JobConfig, out: Path, timeout_s: float = 600.0) -> dict[str, Any]:
    """Train `job` with torch DDP; returns launched_at, ended_at (per step), loss_per_step."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank-*.json"):
        old.unlink()
    store = dist.TCPStore("127.0.0.1", 0, job.replicas + 1, is_master=True,
                          timeout=timedelta(seconds=60), wait_for_workers=False)
    config_path = out / "ddp_config.json"
    config_path.write_text(to_json(ddp_config(job, store.port, out)) + "\n")
    launched = time.time()
    try:
        ranks = run_ranks([[sys.executable, "-m", "recover.bench.ddp_worker", str(config_path),
                            str(rank)] for rank in range(job.replicas)], out, timeout_s, "ddp")
    finally:
        del store
    losses = [sum(column) / job.global_microbatches
              for column in zip(*(r["loss_sums"] for r in ranks), strict=True)]
    return {"mode": "ddp", "launched_at": launched, "ended_at": ranks[0]["ended_at"],
            "loss_per_step": losses}
