"""ReCoVer's failure-free step against torchft's on the same job, side by side (issue 25:
"failure-free fast >= 1.0x torchft on the same job").

The job is `recover bench overhead`'s (the reference TinyGPT, its flags the same here:
`--replicas`, `-M`, `--steps`, `--compute-ms`, ...). Runs alternate, the order rotated each
repetition: ReCoVer with `--reduce fast`, ReCoVer with `--reduce exact`, and torchft 0.2
(`torchft_worker.py`: one replica group per replica, a lighthouse in this process,
`torchft.DistributedDataParallel` over `torchft.ProcessGroupGloo`, `no_sync` accumulation).
Step time as `bench overhead` measures it: the median step-to-step interval after
`--warmup` steps (ReCoVer: commit to commit; torchft: the end of the optimizer step on
replica 0). Also reported: the largest difference of the per-step mean loss from torchft's
(the same microbatches, so fast mode agrees within float rounding).

torchft is not a dependency of this project: install it apart and name the folder,

    pip install --no-deps --target /tmp/tftpkgs torchft==0.2.0
    pip install --target /tmp/tftpkgs 'opentelemetry-sdk>=1.39' 'opentelemetry-exporter-otlp-proto-http>=1.39'
    python bench/scripts/torchft_side_by_side.py --torchft /tmp/tftpkgs --reps 3 \\
        --out bench/results/torchft-side-by-side -- --replicas 4 --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from recover.bench import overhead
from recover.bench.ddp_job import ddp_config
from recover.bench.ddp_worker import to_json
from recover.bench.env import environment
from recover.cli.bench_more import reference_job
from recover.cli.main import build_parser

HERE = Path(__file__).resolve().parent
MODES = ("torchft", "fast", "exact")


def run_torchft(job: Any, folder: Path, torchft_path: str, timeout_s: float) -> dict[str, Any]:
    """Train the job with torchft; per-step end times (replica 0), mean losses, commits."""
    sys.path.append(torchft_path)  # after this environment's packages: only torchft is taken
    from torchft._torchft import LighthouseServer

    folder.mkdir(parents=True, exist_ok=True)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=job.replicas)
    stores = [dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                            timeout=timedelta(seconds=60)) for _ in range(job.replicas)]
    config_path = folder / "config.json"
    config_path.write_text(to_json(ddp_config(job, 0, folder)) + "\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [p for p in (os.environ.get("PYTHONPATH", ""), torchft_path) if p]))
    procs, logs = [], []
    try:
        for rank in range(job.replicas):
            log = open(folder / f"rank-{rank}.log", "wb")  # noqa: SIM115 (closed below)
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, str(HERE / "torchft_worker.py"), str(config_path), str(rank),
                 lighthouse.address(), str(stores[rank].port)],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
        lighthouse.shutdown()
    bad = [(rank, p.returncode) for rank, p in enumerate(procs) if p.returncode != 0]
    if bad:
        rank, code = bad[0]
        tail = (folder / f"rank-{rank}.log").read_text(errors="replace").strip()[-2000:]
        raise SystemExit(f"torchft: replica {rank} exited with {code}:\n{tail}")
    ranks = [json.loads((folder / f"rank-{r}.json").read_text()) for r in range(job.replicas)]
    losses = [sum(column) / job.global_microbatches
              for column in zip(*(r["loss_sums"] for r in ranks), strict=True)]
    return {"ends": ranks[0]["ended_at"], "loss_per_step": losses,
            "all_committed": all(all(r["committed"]) for r in ranks),
            "participants": [r["participants"] for r in ranks]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torchft", required=True, help="a folder with torchft installed")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--run-timeout", type=float, default=600)
    parser.add_argument("job", nargs=argparse.REMAINDER,
                        help="after --: `recover bench overhead`'s job flags")
    args = parser.parse_args()
    flags = args.job[1:] if args.job[:1] == ["--"] else args.job
    bench_args = build_parser().parse_args(["bench", "overhead", "--out", str(args.out), *flags])
    job = reference_job(bench_args, "torchft_side_by_side.py")
    if job.steps < args.warmup + 3:
        parser.error(f"--steps must be at least --warmup + 3 ({args.warmup + 3})")
    args.out.mkdir(parents=True, exist_ok=True)
    config = overhead.OverheadConfig(job=job, out=args.out, reps=args.reps, warmup=args.warmup,
                                     timeout_s=args.run_timeout)
    before = environment()
    runs: list[dict[str, Any]] = []
    losses: dict[str, list[float]] = {}
    for rep in range(args.reps):
        for mode in MODES[rep % 3:] + MODES[:rep % 3]:
            folder = args.out / f"{mode}-{rep}"
            if mode == "torchft":
                result = run_torchft(job, folder, args.torchft, args.run_timeout)
            else:
                result = overhead.run_one(mode, job, folder, config)
            median = statistics.median(overhead.steady_intervals(result["ends"], args.warmup))
            losses.setdefault(mode, result["loss_per_step"])
            runs.append({"mode": mode, "rep": rep, "median_step_s": round(median, 5),
                         "all_committed": result.get("all_committed"),
                         "breakdown": result.get("breakdown")})
            print(f"rep {rep} {mode:<7}: steady step {median * 1000:.1f} ms, final loss "
                  f"{result['loss_per_step'][-1]:.4f}", file=sys.stderr, flush=True)
    step = {m: statistics.median(r["median_step_s"] for r in runs if r["mode"] == m)
            for m in MODES}
    per_rep = {m: [round(next(r["median_step_s"] for r in runs if r["mode"] == "torchft"
                              and r["rep"] == k) /
                         next(r["median_step_s"] for r in runs if r["mode"] == m
                              and r["rep"] == k), 3) for k in range(args.reps)]
               for m in ("fast", "exact")}
    results = {
        "benchmark": "torchft_side_by_side", "job_flags": flags, "reps": args.reps,
        "warmup": args.warmup, "step_s_median": step,
        "speed_vs_torchft": {m: round(step["torchft"] / step[m], 3) for m in ("fast", "exact")},
        "speed_vs_torchft_per_rep": per_rep,
        "max_loss_diff_vs_torchft": {m: max(abs(a - b) for a, b in zip(
            losses[m], losses["torchft"], strict=True)) for m in ("fast", "exact")},
        "torchft_every_step_committed": all(r["all_committed"] for r in runs
                                            if r["mode"] == "torchft"),
        "target": "fast >= 1.0x torchft (torchft's step / ReCoVer's)",
        "runs": runs, "environment_before": before, "environment": environment()}
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: results[k] for k in ("step_s_median", "speed_vs_torchft",
                                              "speed_vs_torchft_per_rep",
                                              "max_loss_diff_vs_torchft",
                                              "torchft_every_step_committed")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
