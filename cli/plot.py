"""`recover plot RUN [RUN ...] --out FILE.png [--x step|time]`: what a run went through.

By step (the default): loss per step, failures marked; each run's absolute loss
difference from the first (the reference: a run that keeps the invariant stays at
zero, a shrinking-batch run drifts away after its first failure); the replicas that
committed each step (capacity lost at a failure, back when a replica joined).

By wall time (`--x time`, cli/timeline.py): loss, steps committed, live replicas and
tokens/s against seconds since the start, with each recovery's stall and each join
shaded; a checkpoint-and-restart run of `recover run --mode ckpt-restart` overlays with
its restarts shaded and its re-done steps visible. `recover run` draws this figure of
its own run as OUT/plot.png.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from recover.cli.jobargs import UsageError
from recover.cli.verify import load_summary

FLOOR = 1e-12
"""Differences are drawn on a log scale; exact zeros sit on this floor."""


def label_of(summary: dict[str, Any], path: str) -> str:
    failures = len(summary["failures"])
    if summary.get("mode") == "ckpt-restart":
        return f"{Path(path).name}: checkpoint-and-restart, {failures} failures"
    policy = summary.get("policy", "recover")
    plural = "s" if failures != 1 else ""
    kind = "failure-free" if not failures else f"{failures} failure{plural}, policy {policy}"
    return f"{Path(path).name}: {kind}, reduce {summary['reduce']}"


AXES = ("step", "time")


def load_run(path: str) -> dict[str, Any]:
    """A run's summary: ReCoVer's (checked like `recover verify` does) or a
    checkpoint-and-restart baseline's (`recover run --mode ckpt-restart`)."""
    candidate = Path(path)
    if candidate.is_dir():
        candidate = candidate / "summary.json"
    try:
        summary = json.loads(candidate.read_text())
    except (OSError, ValueError):
        summary = None  # load_summary says why, in one line
    if isinstance(summary, dict) and summary.get("mode") == "ckpt-restart":
        if not isinstance(summary.get("commit_timeline"), list):
            raise UsageError(f"recover plot: {candidate} is a ckpt-restart summary without "
                             "its commit_timeline")
        return summary
    return load_summary(path, "plot")


def plot(runs: list[str], out: str, labels: list[str] | None = None, x: str = "step") -> Path:
    """Draw `runs` (the first is the reference) to the PNG `out`, by step or wall time."""
    if not runs:
        raise UsageError("recover plot: name at least one run")
    if labels and len(labels) != len(runs):
        raise UsageError(f"recover plot: {len(labels)} labels for {len(runs)} runs")
    if x not in AXES:
        raise UsageError(f"recover plot: --x {x!r}: choose step or time")
    target = _target(out)
    summaries = [load_run(run) for run in runs]
    if x == "step" and any(s.get("mode") == "ckpt-restart" for s in summaries):
        raise UsageError("recover plot: a ckpt-restart run has no per-step ledger to compare "
                         "by step: plot it with --x time")
    plt = _pyplot()
    if x == "time":
        from recover.cli.timeline import draw_timeline

        fig = draw_timeline(plt, summaries, runs,
                            labels or [label_of(s, r) for s, r in zip(summaries, runs, strict=True)])
    else:
        fig = draw(plt, summaries, runs, labels)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(target, dpi=110)
    except OSError as error:
        raise UsageError(f"recover plot: cannot write {target}: {error.strerror}") from None
    finally:
        plt.close(fig)
    return target


def _target(out: str) -> Path:
    """Where the PNG goes, or one line saying why it cannot go there (before any drawing)."""
    target = Path(out)
    if target.suffix.lower() != ".png":
        raise UsageError(f"recover plot: --out {out!r}: name a .png file (the figure is a PNG)")
    if target.is_dir():
        raise UsageError(f"recover plot: --out {out!r} is a folder, not a file")
    blocking = next((p for p in target.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise UsageError(f"recover plot: cannot write {target}: {blocking} is a file, not a folder")
    return target


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("recover plot: matplotlib is not installed (pip install matplotlib)") from None
    return plt


def draw(plt: Any, summaries: list[dict[str, Any]], runs: list[str],
         labels: list[str] | None = None) -> Any:
    """The figure: loss per step on top (failures marked), |loss - reference| in the middle,
    live replicas per step below."""
    reference = summaries[0]["loss_per_step"]
    fig, (top, bottom, strength) = plt.subplots(3, 1, figsize=(9, 9), sharex=True,
                                                gridspec_kw={"height_ratios": [3, 2, 1.4]})
    for index, (summary, run) in enumerate(zip(summaries, runs, strict=True)):
        label = labels[index] if labels else label_of(summary, run)
        losses = summary["loss_per_step"]
        style = {"linewidth": 2.5 - 0.6 * index, "zorder": 3 - index}
        (line,) = top.plot(range(len(losses)), losses, label=label, **style)
        diffs = [max(abs(a - b), FLOOR) for a, b in zip(losses, reference, strict=False)]
        if index:
            bottom.plot(range(len(diffs)), diffs, color=line.get_color(), label=label, **style)
        replicas = summary.get("replicas_per_step") or []  # absent in older summaries
        if replicas:
            strength.step(range(len(replicas)), replicas, where="post", color=line.get_color(),
                          label=label, linewidth=style["linewidth"])
        for failure in summary["failures"]:
            step = failure["step"]
            if step < len(losses):
                top.scatter([step], [losses[step]], marker="x", s=80, color=line.get_color(), zorder=5)
                top.axvline(step, color=line.get_color(), alpha=0.25, linestyle="--")
    top.set_ylabel("loss")
    top.set_title("loss per step (x: a replica failed in that step)")
    top.legend(fontsize=8)
    bottom.set_yscale("log")
    bottom.set_ylim(FLOOR / 2, None)
    bottom.set_ylabel(f"|loss - {Path(runs[0]).name}|\n(bottom line: identical)")
    if len(summaries) > 1:  # one run has no difference to draw, nor a legend for it
        bottom.legend(fontsize=8)
    strength.set_ylabel("live replicas")
    strength.set_xlabel("step")
    strength.yaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    return fig
