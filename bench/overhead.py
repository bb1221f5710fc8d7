"""`recover bench overhead`: failure-free step time of ReCoVer (fast, exact) vs plain torch DDP,
and with `--torchft DIR` vs torchft 0.2 (`recover.bench.torchft_job`) too.

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
from recover.bench.torchft_job import run_torchft
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
    torchft: str = ""
    """A folder with torchft 0.2 installed (not a dependency of this project): adds its
    failure-free step as a fourth mode; empty: not run."""

    @property
    def modes(self) -> tuple[str, ...]:
        return (*MODES, "torchft") if self.torchft else MODES


def steady_intervals(ends: list[float], warmup: int) -> list[float]:
    """Step-to-step intervals after the first `warmup` steps (pure)."""
    kept = ends[warmup:]
    return [b - a for a, b in zip(kept, kept[1:], strict=False)]


def median_step_s(summary: dict[str, Any], warmup: int) -> float:
    """A run's median seconds between commits (summary.json), the first `warmup` steps
    (start-up) left out."""
    ends = [x for x in summary["committed_at_s_per_step"] if x is not None]
    return statistics.median(steady_intervals(ends, warmup))


def order(rep: int, modes: tuple[str, ...] = MODES) -> list[str]:
    """Mode order of repetition `rep`: rotated so no mode always runs first (pure)."""
    k = rep % len(modes)
    return list(modes[k:] + modes[:k])


def paired(runs: list[dict[str, Any]], mode: str, baseline: str = "ddp") -> list[float]:
    """Per repetition: mode's median step / the baseline's - 1 (pure)."""
    by = {(r["mode"], r["rep"]): r["median_step_s"] for r in runs}
    reps = sorted({r["rep"] for r in runs})
    return [round(by[(mode, k)] / by[(baseline, k)] - 1, 4) for k in reps
            if (mode, k) in by and (baseline, k) in by]


def run_one(mode: str, job: pb.JobConfig, folder: Path, config: OverheadConfig) -> dict[str, Any]:
    """One run of `mode` (ddp, fast, exact, torchft): its per-step end times, losses, and
    ReCoVer's step split (None for the baselines)."""
    if mode in ("ddp", "torchft"):
        result = (run_ddp(job, folder, config.timeout_s) if mode == "ddp"
                  else run_torchft(job, folder, config.torchft, config.timeout_s))
        return {"ends": result["ended_at"], "loss_per_step": result["loss_per_step"],
                "breakdown": None, "all_committed": result.get("all_committed")}
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
    total = config.reps * len(config.modes)
    for rep in range(config.reps):
        for mode in order(rep, config.modes):
            folder = config.out / f"{mode}-{rep}"
            result = run_one(mode, job, folder, config)
            intervals = steady_intervals(result["ends"], config.warmup)
            median = statistics.median(intervals)
            losses.setdefault(mode, result["loss_per_step"])
            runs.append({"mode": mode, "rep": rep, "median_step_s": round(median, 5),
                         "intervals": len(intervals), "breakdown": result["breakdown"],
                         "final_loss": result["loss_per_step"][-1],
                         "all_committed": result.get("all_committed")})
            progress(f"[{len(runs)}/{total}] {mode:<7} rep {rep}: steady step "
                     f"{median * 1000:.1f} ms over {len(intervals)} steps, final loss "
                     f"{result['loss_per_step'][-1]:.4f}")
    step = {m: statistics.median(r["median_step_s"] for r in runs if r["mode"] == m)
            for m in config.modes}
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
    if config.torchft:
        results.update(vs_torchft(runs, step, losses))
    return results


def vs_torchft(runs: list[dict[str, Any]], step: dict[str, float],
               losses: dict[str, list[float]]) -> dict[str, Any]:
    """ReCoVer against torchft: the speed ratio (torchft's step / ReCoVer's: >= 1 is as
    fast or faster), by repetition too, and the largest per-step loss difference."""
    by = {(r["mode"], r["rep"]): r["median_step_s"] for r in runs}
    reps = sorted({r["rep"] for r in runs})
    return {
        "speed_vs_torchft": {m: round(step["torchft"] / step[m], 4) for m in ("fast", "exact")},
        "speed_vs_torchft_per_rep": {m: [round(by[("torchft", k)] / by[(m, k)], 4)
                                         for k in reps if (m, k) in by and ("torchft", k) in by]
                                     for m in ("fast", "exact")},
        "max_loss_diff_vs_torchft": {m: max(abs(a - b) for a, b in zip(
            losses[m], losses["torchft"], strict=True)) for m in ("fast", "exact")},
        "torchft_every_step_committed": all(r["all_committed"] for r in runs
                                            if r["mode"] == "torchft"),
    }


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
             *torchft_lines(results),
             f"load average: {results['environment']['loadavg_1m']} at start, "
             f"{results['loadavg_1m_end']} at end"]
    return "\n".join(lines)


def torchft_lines(results: dict[str, Any]) -> list[str]:
    if "speed_vs_torchft" not in results:
        return []
    speed, step = results["speed_vs_torchft"], results["step_s"]
    return [f"{'torchft 0.2 (gloo)':<22} {step['torchft'] * 1000:>9.1f} ms",
            f"speed vs torchft (torchft's step / ReCoVer's): fast {speed['fast']:.3f}, exact "
            f"{speed['exact']:.3f}; per repetition fast "
            + ", ".join(f"{x:.3f}" for x in results["speed_vs_torchft_per_rep"]["fast"]),
            f"loss vs torchft, max over steps: fast "
            f"{results['max_loss_diff_vs_torchft']['fast']:.2e}, exact "
            f"{results['max_loss_diff_vs_torchft']['exact']:.2e}; every torchft step committed: "
            f"{results['torchft_every_step_committed']}"]


__all__ = ["JobFailed", "OverheadConfig", "format_table", "order", "run", "steady_intervals"]
