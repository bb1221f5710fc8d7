"""Turn the controller's run report into `summary.json` and a short text summary.

`recover run` writes it at the end of a local job; a controller started by
hand writes it with `--summary-out DIR`, and `recover summary` fetches it
from a running or finished controller.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from recover.proto import pb


def agreed_digest(record: pb.StepRecord) -> str | None:
    """The parameter digest all replicas reported after a step, or None if they disagree."""
    digests = {d.param_sha256 for d in record.param_sha256}
    return digests.pop() if len(digests) == 1 else None


def failure_entry(failure: pb.FailureRecord, started_at: float) -> dict[str, Any]:
    """One failure, with latencies measured from the kill when its time is known.

    detected_s: kill -> controller knows (None when the kill was not injected,
    so its time is unknown). recovered_s: kill (else detection) -> every
    survivor computes again in the new generation (None if it never did).
    """
    origin = failure.killed_at or failure.detected_at
    entry: dict[str, Any] = {
        "step": failure.step,
        "replica": failure.replica,
        "phase": failure.phase,
        "cause": failure.cause,
        "generation": failure.generation,
        "at_s": round(failure.detected_at - started_at, 4) if started_at else None,
        "detected_s": round(failure.detected_at - failure.killed_at, 4)
        if failure.killed_at else None,
        "recovered_s": round(failure.recovered_at - origin, 4) if failure.recovered_at else None,
    }
    if failure.HasField("error"):
        entry["error"] = failure.error.message
        entry["traceback"] = failure.error.traceback
    return entry


def step_time(steps: list[pb.StepRecord]) -> dict[str, float] | None:
    """Median step wall time (commit to commit) and where it goes, failure-free steps only.

    compute_s: the slowest replica's compute (the critical path); reduce_s: the
    last replica's allreduce (communication, no waiting for stragglers);
    commit_wait_s: reporting the reduction -> receiving the commit (the control
    plane's round trip); other_s: the rest (load imbalance, optimizer step, data).
    """
    rows = [(r.committed_at - p.committed_at, r.compute_s, r.reduce_s, r.commit_wait_s)
            for p, r in itertools.pairwise(steps) if r.generation == p.generation]
    if not rows:
        return None
    wall, comp, red, wait = (statistics.median(column) for column in zip(*rows, strict=True))
    return {"median_s": round(wall, 5), "compute_s": round(comp, 5), "reduce_s": round(red, 5),
            "commit_wait_s": round(wait, 5), "other_s": round(max(wall - comp - red - wait, 0.0), 5)}


def build_summary(report: pb.RunReport, wall_s: float) -> dict[str, Any]:
    steps = list(report.steps)
    per_replica = [
        {str(d.replica): d.param_sha256 for d in record.param_sha256} for record in steps]
    return {
        "job_id": report.job.job_id,
        "state": report.status.state,
        "reason": report.status.reason,
        "replicas": report.job.replicas,
        "live_replicas": list(report.status.live_replicas),
        "reduce": report.job.reduce,
        "policy": report.job.policy or "proportional",
        "exact_redos": report.status.redos,
        "seed": report.job.seed,
        "steps_requested": report.job.steps,
        "steps_committed": len(steps),
        "global_microbatches": report.job.global_microbatches,
        # Samples per microbatch, when the workload's source says (a dataset source does).
        "microbatch_size": report.workload.samples_per_microbatch or None,
        "workload": {
            "command": list(report.job.workload.command),
            "parameters": report.workload.parameters,
            "gradient_buckets": list(report.workload.gradient_buckets),
            "reduce_pieces": report.workload.reduce_pieces,
            "determinism_sha256": report.workload.determinism_sha256 or None,
        },
        # How the parameter digests below were made (an older build's: one sha256 stream).
        "digest_scheme": report.workload.digest_scheme
        or ("sha256" if report.workload.parameters else None),
        "microbatches_per_step": [record.microbatches for record in steps],
        "sample_digest_per_step": [record.sample_digest for record in steps],
        # The ledger's sample ids themselves (sorted per step), with --record-sample-ids only.
        "sample_ids_per_step": [list(record.sample_ids) for record in steps]
        if report.job.record_sample_ids else None,
        "loss_per_step": [record.loss for record in steps],
        "generation_per_step": [record.generation for record in steps],
        # Members that committed each step: the job's strength over time (failures, joins).
        "replicas_per_step": [record.replicas for record in steps],
        "step_time": step_time(steps),
        # Per step: the slowest replica's compute, and the commit round trip (reduced
        # reported -> commit received); bench recovery splits recoveries with them.
        "compute_s_per_step": [round(record.compute_s, 5) for record in steps],
        # Per step: how many microbatches each member summed (its quota, plus what it
        # took over in a recovery).
        "microbatches_by_replica_per_step": [
            {str(load.replica): load.microbatches for load in record.loads} for record in steps],
        # Per step: microbatches work-stealing moved between members (--work-stealing).
        "stolen_per_step": [record.stolen for record in steps],
        "work_stealing": report.job.work_stealing,
        "commit_wait_s_per_step": [round(record.commit_wait_s, 5) for record in steps],
        "param_sha256_per_step": [agreed_digest(record) for record in steps],
        "param_sha256_by_replica_per_step": per_replica,
        "param_sha256": agreed_digest(steps[-1]) if steps else None,
        "failures": [failure_entry(f, report.started_at) for f in report.failures],
        "recoveries": report.status.recoveries,
        # Per recovery this controller saw: seconds in detect, plan, rebuild, recompute, commit.
        "recovery_phases_s": [{field.name.removesuffix("_s"): round(getattr(timing, field.name), 5)
                               for field in timing.DESCRIPTOR.fields}
                              for timing in report.recovery_timings],
        "wall_s": round(wall_s, 3),
        "train_s": round(report.finished_at - report.started_at, 3)
        if report.finished_at and report.started_at else None,
        "tokens": sum(record.tokens for record in steps),
        "tokens_per_step": [record.tokens for record in steps],
        # Each replica that joined the running job: seconds from the start to its join's
        # start (state transfer) and to its entry as a member.
        "joins": [{"replica": j.replica, "spare": j.spare,
                   "started_at_s": round(j.started_at - report.started_at, 4),
                   "entered_at_s": round(j.entered_at - report.started_at, 4)}
                  for j in report.joins] if report.started_at else [],
        "compute_ms": report.job.testing.compute_ms,
        "started_at": report.started_at,
        # Seconds from the job's start to each step's commit (cumulative-tokens plots).
        "committed_at_s_per_step": [round(record.committed_at - report.started_at, 4)
                                    if report.started_at else None for record in steps],
        # Where `--resume` would start from (the newest checkpoint written, if any).
        "last_checkpoint": {"step": report.last_checkpoint.step,
                            "path": report.last_checkpoint.path}
        if report.HasField("last_checkpoint") else None,
    }


def write_summary(summary: dict[str, Any], out_dir: str | os.PathLike[str]) -> Path:
    """Write OUT_DIR/summary.json atomically (a reader never sees half a file)."""
    target = Path(out_dir) / "summary.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".summary.json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, target)
    return target


def format_summary(summary: dict[str, Any]) -> str:
    losses = summary["loss_per_step"]
    failures = summary["failures"]
    phases = Counter(f["phase"] for f in failures)
    recovered = [f["recovered_s"] for f in failures if f["recovered_s"] is not None]
    lines = [
        f"{summary['state']}: {summary['steps_committed']}/{summary['steps_requested']} steps, "
        f"{summary['global_microbatches']} microbatches each"
        + (f" ({summary['reason']})" if summary["state"] != "succeeded" and summary["reason"]
           else ""),
    ]
    if losses:
        lines.append(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    by_phase = ", ".join(f"{n} {p}" for p, n in phases.items())
    lines.append(
        f"{len(failures)} failure{'' if len(failures) == 1 else 's'}"
        + (f" ({by_phase})" if failures else "")
        + (f", recovered in {min(recovered):.3f}-{max(recovered):.3f}s" if recovered else ""))
    lines.append(f"{len(summary['live_replicas'])} of {summary['replicas']} replicas left; "
                 f"{summary['tokens']} tokens in {summary['wall_s']:.1f}s")
    if summary["param_sha256"]:
        lines.append(f"final parameters sha256 {summary['param_sha256'][:16]}...")
    if summary.get("last_checkpoint"):
        checkpoint = summary["last_checkpoint"]
        lines.append(f"last checkpoint: the state before step {checkpoint['step']}, "
                     f"{checkpoint['path']}")
    return "\n".join(lines)
