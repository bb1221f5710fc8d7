"""`recover bench throughput`: ReCoVer vs checkpoint-and-restart on the same job and schedule.

Three real runs of the same job (model, data, M, microbatch size, seed,
`--compute-ms`): a failure-free ReCoVer reference, ReCoVer with the schedule's
failures (kill -9 of worker PIDs from outside), and the ckpt-restart baseline
with the same failures (its supervisor kills the slot's worker). Each run's
clock starts when it is launched, so start-up is paid by both; a run's time
ends at its last committed step.

Metrics (useful tokens = committed steps x M x B x seq_len; re-done steps count once):
* tokens per wall-second;
* tokens per provisioned slot-hour (every slot of the job at start, for the whole run:
  what one pays for when failed hosts are not given back);
* tokens per alive-slot-second (the paper's metric: slots not failed, per the schedule).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recover.bench.ckpt_policy import CheckpointPolicy
from recover.bench.ckpt_restart import CkptRestartConfig
from recover.bench.ckpt_restart import run as run_ckpt
from recover.bench.env import environment
from recover.bench.recover_job import run_recover
from recover.bench.reference import reference_config, tokens_per_step
from recover.bench.schedules import Schedule
from recover.client.launch import hand_over
from recover.proto import pb

RUNS = ("reference", "recover", "ckpt-restart")


@dataclass
class ThroughputConfig:
    """One `bench throughput` invocation."""

    job: pb.JobConfig
    """The job every run trains (validated by the CLI; the built-in reference GPT only)."""
    schedule: Schedule
    """Failures for the ReCoVer and ckpt-restart runs."""
    schedule_path: str
    """Where the schedule came from (recorded in results.json)."""
    out: Path
    """DIR: results.json, PNGs and one folder per run."""
    policy: CheckpointPolicy
    """The baseline's checkpoint interval rule."""
    timeout_s: float = 600.0
    """Per-run limit."""


def metrics(run: dict[str, Any], schedule: Schedule | None, replicas: int) -> dict[str, Any]:
    """The three throughput figures of one run (schedule None: no failures)."""
    end = run["end_s"]
    tokens = run["tokens"]
    # Schedule times count from the run's first commit; turn them into launch-relative ones.
    first = run["commit_timeline"][0][0]
    alive_s = (schedule.alive_slot_seconds(-first, end - first) if schedule is not None
               else replicas * end)
    return {
        "steps": run["steps_committed"], "tokens": tokens, "wall_s": round(end, 3),
        "first_commit_s": round(first, 3),
        "tokens_per_wall_s": tokens / end,
        "tokens_per_slot_hour": tokens / (replicas * end / 3600.0),
        "tokens_per_alive_slot_s": tokens / alive_s,
        # Without start-up (which differs: ReCoVer starts a controller and agents too).
        "tokens_per_wall_s_after_first_commit": (tokens - tokens / run["steps_committed"])
        / (end - first) if end > first else None,
        "alive_slot_s": round(alive_s, 3),
        "final_loss": run["loss_per_step"][-1],
    }


def _speedups(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    return {f"speedup_{key}": round(a[key] / b[key], 4) if a[key] and b[key] else None
            for key in ("tokens_per_wall_s", "tokens_per_slot_hour", "tokens_per_alive_slot_s",
                        "tokens_per_wall_s_after_first_commit")}


def run(config: ThroughputConfig, progress: Any = None) -> dict[str, Any]:
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    out, job = config.out, config.job
    # Before the first run: the ckpt-restart baseline can only train the reference GPT.
    workload = reference_config(job, "recover bench throughput")
    out.mkdir(parents=True, exist_ok=True)
    say(f"bench throughput: reference (no failures) -> {out / 'reference'}")
    job_args = hand_over(job, out / "job.binpb")  # every ReCoVer run trains this very job
    reference = run_recover(out / "reference", job_args, None, say, "reference",
                            config.timeout_s)
    say(f"bench throughput: recover with {len(config.schedule.events)} scheduled failures")
    # A slot comes back when the schedule says (a replacement agent), not by a restart.
    returns = any(e.returns_at_s is not None for e in config.schedule.events)
    recover_args = ["--max-restarts", "0", *job_args] if returns else job_args
    recover = run_recover(out / "recover", recover_args, config.schedule, say, "recover",
                          config.timeout_s)
    say("bench throughput: ckpt-restart with the same failures")
    ckpt = run_ckpt(CkptRestartConfig(job=job, out=out / "ckpt-restart", policy=config.policy,
                                      schedule=config.schedule, progress=say))
    if ckpt["state"] != "succeeded":
        raise RuntimeError(f"ckpt-restart: {ckpt['reason']}")
    runs = {"reference": reference, "recover": recover, "ckpt-restart": ckpt}
    table = {"reference": metrics(reference, None, job.replicas),
             "recover": metrics(recover, config.schedule, job.replicas),
             "ckpt-restart": metrics(ckpt, config.schedule, job.replicas)}
    results: dict[str, Any] = {
        "benchmark": "throughput", "environment": environment(),
        "job": {"replicas": job.replicas, "steps": job.steps, "global_microbatches":
                job.global_microbatches, "microbatch_size": workload.microbatch_size,
                "seq_len": workload.seq_len, "compute_ms": job.testing.compute_ms,
                "seed": job.seed},
        "schedule": {"path": config.schedule_path, "kind": config.schedule.kind,
                     "events": [vars(e) for e in config.schedule.events]},
        "checkpoint_policy": config.policy.to_dict(),
        "runs": table,
        **_speedups(table["recover"], table["ckpt-restart"]),
        "recover_vs_reference_tokens_per_wall_s": round(
            table["recover"]["tokens_per_wall_s"] / table["reference"]["tokens_per_wall_s"], 4),
        "failures_hit": {"recover": sum(1 for k in recover["kills"] if k["pid"] is not None),
                         "ckpt-restart": sum(1 for f in ckpt["failures"] if f["hit_running_worker"])},
        "ckpt_restarts": ckpt["restarts"],
        "ckpt_checkpoints": len(ckpt["checkpoints"]),
        "ckpt_steps_redone": ckpt["steps_redone"],
        "recover_recovered_s": [f["recovered_s"] for f in recover["failures"]],
        "max_abs_loss_diff_vs_reference": {
            name: max(abs(a - b) for a, b in zip(runs[name]["loss_per_step"],
                                                  reference["loss_per_step"], strict=False))
            for name in ("recover", "ckpt-restart")},
        "recover_returns": recover["returns"],
        "notes": "A returned slot is a replacement agent that joins the running ReCoVer job "
                 "(live state transfer; workers are not restarted otherwise); ckpt-restart "
                 "uses returned slots from its next restart on. Alive slots follow the "
                 "schedule for both.",
    }
    results["calibration_inputs"] = {
        "recover": {"commit_timeline": recover["commit_timeline"], "end_s": recover["end_s"],
                    "kills_s": [k["killed_at_s"] for k in recover["kills"] if k["pid"] is not None],
                    "recovered_s": [f["recovered_s"] for f in recover["failures"]
                                    if f["recovered_s"] is not None]},
        "ckpt-restart": {"commit_timeline": ckpt["commit_timeline"], "end_s": ckpt["end_s"],
                         "write_s": [c["write_s"] for c in ckpt["checkpoints"]],
                         "restarts": ckpt["restarts"]},
    }
    results["plots"] = plots(runs, tokens_per_step(job, workload), out)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def plots(runs: dict[str, dict[str, Any]], per_step: int, out: Path) -> list[str]:
    """Cumulative useful tokens (`per_step` per committed step) over time, and loss per step;
    returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for name, r in runs.items():
        # Progress falls back at a restart: steps after the checkpoint are done again.
        xs = [0.0] + [t for t, _ in r["commit_timeline"]]
        ys = [0] + [(step + 1) * per_step for _, step in r["commit_timeline"]]
        (line,) = ax.step(xs, ys, where="post", label=name)
        kills = [k["killed_at_s"] for k in r.get("kills", [])] + \
                [f["killed_at_s"] for f in r.get("failures", []) if "killed_at_s" in f]
        for t in kills:
            ax.axvline(t, color=line.get_color(), alpha=0.3, linestyle="--")
    ax.set_xlabel("seconds since launch")
    ax.set_ylabel("tokens (committed training progress)")
    ax.set_title("cumulative tokens (dashed: failures)")
    ax.legend()
    fig.tight_layout()
    tokens_png = out / "tokens_over_time.png"
    fig.savefig(tokens_png, dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(9, 5))
    for index, (name, r) in enumerate(runs.items()):
        losses = r["loss_per_step"]
        ax.plot(range(len(losses)), losses, label=name, linewidth=2.5 - 0.7 * index)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("loss per step (same M every step: the curves coincide)")
    ax.legend()
    fig.tight_layout()
    loss_png = out / "loss_per_step.png"
    fig.savefig(loss_png, dpi=110)
    plt.close(fig)
    return [str(tokens_png), str(loss_png)]


def format_table(results: dict[str, Any]) -> str:
    rows = [f"{'run':<14}{'steps':>6}{'wall s':>9}{'tok/wall-s':>12}{'tok/slot-h':>13}"
            f"{'tok/alive-slot-s':>18}{'final loss':>12}"]
    for name in RUNS:
        m = results["runs"][name]
        rows.append(f"{name:<14}{m['steps']:>6}{m['wall_s']:>9.1f}{m['tokens_per_wall_s']:>12.0f}"
                    f"{m['tokens_per_slot_hour']:>13.3g}{m['tokens_per_alive_slot_s']:>18.0f}"
                    f"{m['final_loss']:>12.4f}")
    rows.append(f"ReCoVer / ckpt-restart: {results['speedup_tokens_per_wall_s']:.2f}x tokens/wall-s, "
                f"{results['speedup_tokens_per_slot_hour']:.2f}x tokens/slot-hour, "
                f"{results['speedup_tokens_per_alive_slot_s']:.2f}x tokens/alive-slot-s; "
                f"{results['speedup_tokens_per_wall_s_after_first_commit'] or 0:.2f}x "
                "tokens/wall-s after the first commit (start-up excluded)")
    rows.append(f"failures hit: recover {results['failures_hit']['recover']}, ckpt-restart "
                f"{results['failures_hit']['ckpt-restart']}; ckpt-restart restarts "
                f"{len(results['ckpt_restarts'])}, steps redone {results['ckpt_steps_redone']}")
    return "\n".join(rows)
