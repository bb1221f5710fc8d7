"""`recover bench overhead`: failure-free step time of ReCoVer (fast, exact) vs plain torch DDP.

Same job for all three (TinyGPT, data, M, B, replicas, seed, AdamW): a real
`recover run` with --reduce fast, one with --reduce exact, and the DDP
baseline (`recover.bench.ddp_job`). Runs alternate (ddp, fast, exact, then
the next repetition rotated by one) so that the load other people put on
the machine hits every mode alike.

Step time is measured in steady state: the first `warmup` steps of each run
are skipped (first-touch allocations, gloo connection set-up, a cold
controller), then the median of the step-to-step intervals (ReCoVer: commit
to commit, from its summary.json; DDP: optimizer step to optimizer step on
rank 0). A mode's figure is the median over its runs' medians.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recover.bench.ddp_job import run_ddp
from recover.bench.env import environment
from recover.bench.recover_job import JobFailed, run_recover
from recover.bench.reference import reference_config
from recover.client.launch import hand_over
from recover.proto import pb

MODES = ("ddp", "fast", "exact")


@dataclass
class OverheadConfig:
    """One `bench overhead` invocation."""

    job: pb.JobConfig
    """The job every mode trains (its `reduce` is overridden per mode); the built-in
    reference GPT only, since the DDP baseline re-implements it."""
    out: Path
    """results.json and one folder per run."""
    reps: int = 2
    """Runs per mode."""
    warmup: int = 5
    """Steps skipped at the start of every run before step times count."""
    timeout_s: float = 300.0
    """Limit per run."""


def steady_intervals(ends: list[float], warmup: int) -> list[float]:
    """Step-to-step intervals after the first `warmup` steps (pure)."""
    kept = ends[warmup:]
    return [b - a for a, b in zip(kept, kept[1:], strict=False)]


def median_step_s(summary: dict[str, Any], warmup: int) -> float:
    """A run's median seconds between commits (summary.json), the first `warmup` steps
    (start-up) left out."""
    ends = [x for x in summary["committed_at_s_per_step"] if x is not None]
    return statistics.median(steady_intervals(ends, warmup))


def order(rep: int) -> list[str]:
    """Mode order of repetition `rep`: rotated so no mode always runs first (pure)."""
    k = rep % len(MODES)
    return list(MODES[k:] + MODES[:k])


def paired(runs: list[dict[str, Any]], mode: str) -> list[float]:
    """Per repetition: mode's median step / DDP's - 1 (pure)."""
    by = {(r["mode"], r["rep"]): r["median_step_s"] for r in runs}
    reps = sorted({r["rep"] for r in runs})
    return [round(by[(mode, k)] / by[("ddp", k)] - 1, 4) for k in reps
            if (mode, k) in by and ("ddp", k) in by]


def run_one(mode: str, job: pb.JobConfig, folder: Path, config: OverheadConfig) -> dict[str, Any]:
    """One run of `mode` (ddp, fast, exact): its per-step end times, losses, and ReCoVer's
    step split (None for DDP)."""
    if mode == "ddp":
        result = run_ddp(job, folder, config.timeout_s)
        ends = result["ended_at"]
        return {"ends": ends, "loss_per_step": result["loss_per_step"], "breakdown": None}
    mode_job = pb.JobConfig()
    mode_job.CopyFrom(job)
    mode_job.reduce = mode
    # No kills to time: poll the controller rarely, so the bench itself costs the job no CPU.
    job_args = hand_over(mode_job, config.out / f"job-{mode}.binpb")
    summary = run_recover(folder, job_args, label=mode, timeout_s=config.timeout_s,
                          poll_s=1.0)
    ends = [t for t in summary["committed_at_s_per_step"] if t is not None]
    return {"ends": ends, "loss_per_step": summary["loss_per_step"],
            "breakdown": summary["step_time"]}


def run(config: OverheadConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    job = config.job
    if job.steps < config.warmup + 3:
        raise ValueError(f"--steps must be at least warmup + 3 = {config.warmup + 3}")
    workload = reference_config(job, "recover bench overhead")
    env = environment()
    runs: list[dict[str, Any]] = []
    losses: dict[str, list[float]] = {}
    total = config.reps * len(MODES)
    for rep in range(config.reps):
        for mode in order(rep):
            folder = config.out / f"{mode}-{rep}"
            result = run_one(mode, job, folder, config)
            intervals = steady_intervals(result["ends"], config.warmup)
            median = statistics.median(intervals)
            losses.setdefault(mode, result["loss_per_step"])
            runs.append({"mode": mode, "rep": rep, "median_step_s": round(median, 5),
                         "intervals": len(intervals), "breakdown": result["breakdown"],
                         "final_loss": result["loss_per_step"][-1]})
            progress(f"[{len(runs)}/{total}] {mode:<5} rep {rep}: steady step "
                     f"{median * 1000:.1f} ms over {len(intervals)} steps, final loss "
                     f"{result['loss_per_step'][-1]:.4f}")
    step = {m: statistics.median(r["median_step_s"] for r in runs if r["mode"] == m)
            for m in MODES}
    ddp_loss = losses["ddp"]
    results: dict[str, Any] = {
        "benchmark": "overhead",
        "environment": env,
        "loadavg_1m_end": environment()["loadavg_1m"],
        "config": {"replicas": job.replicas, "global_microbatches": job.global_microbatches,
                   "microbatch_size": workload.microbatch_size, "steps": job.steps,
                   "warmup_steps": config.warmup, "reps": config.reps, "seed": job.seed,
                   "compute_ms": job.testing.compute_ms, "n_layer": workload.n_layer,
                   "n_embd": workload.n_embd},
        "step_s": {m: round(v, 5) for m, v in step.items()},
        "overhead_vs_ddp": round(step["fast"] / step["ddp"] - 1, 4),
        "overhead_exact_vs_ddp": round(step["exact"] / step["ddp"] - 1, 4),
        "overhead_exact_vs_fast": round(step["exact"] / step["fast"] - 1, 4),
        # Paired by repetition (runs close in time share the machine's load): the spread.
        "overhead_vs_ddp_per_rep": paired(runs, "fast"),
        "overhead_exact_vs_ddp_per_rep": paired(runs, "exact"),
        "max_loss_diff_fast_vs_ddp": max(abs(a - b) for a, b in
                                         zip(losses["fast"], ddp_loss, strict=True)),
        "max_loss_diff_exact_vs_ddp": max(abs(a - b) for a, b in
                                          zip(losses["exact"], ddp_loss, strict=True)),
        "runs": runs,
    }
    return results


def format_table(results: dict[str, Any]) -> str:
    step = results["step_s"]
    lines = [f"{'mode':<22} {'steady step':>12} {'vs DDP':>8}",
             f"{'torch DDP (gloo)':<22} {step['ddp'] * 1000:>9.1f} ms {'-':>8}",
             f"{'ReCoVer fast':<22} {step['fast'] * 1000:>9.1f} ms "
             f"{results['overhead_vs_ddp'] * 100:>+7.1f}%",
             f"{'ReCoVer exact':<22} {step['exact'] * 1000:>9.1f} ms "
             f"{results['overhead_exact_vs_ddp'] * 100:>+7.1f}%",
             "per repetition vs DDP: fast "
             + ", ".join(f"{x * 100:+.1f}%" for x in results["overhead_vs_ddp_per_rep"])
             + "; exact " + ", ".join(f"{x * 100:+.1f}%" for x in results["overhead_exact_vs_ddp_per_rep"]),
             f"loss vs DDP, max over steps: fast {results['max_loss_diff_fast_vs_ddp']:.2e}, "
             f"exact {results['max_loss_diff_exact_vs_ddp']:.2e}",
             f"load average: {results['environment']['loadavg_1m']} at start, "
             f"{results['loadavg_1m_end']} at end"]
    return "\n".join(lines)


__all__ = ["JobFailed", "OverheadConfig", "format_table", "order", "run", "steady_intervals"]
