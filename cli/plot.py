"""`recover plot RUN [RUN ...] --out FILE.png`: loss per step, failures marked.

The first run is the reference. A second panel shows each run's absolute
loss difference from it: a run that keeps the invariant (exact reduction)
stays at zero, a shrinking-batch run drifts away after its first failure. A
third shows the replicas that committed each step: capacity lost at a
failure, back when a restarted or spare replica joined.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from recover.cli.jobargs import UsageError
from recover.cli.verify import load_summary

FLOOR = 1e-12
"""Differences are drawn on a log scale; exact zeros sit on this floor."""


def label_of(summary: dict[str, Any], path: str) -> str:
    failures = len(summary["failures"])
    policy = summary.get("policy", "recover")
    plural = "s" if failures != 1 else ""
    kind = "failure-free" if not failures else f"{failures} failure{plural}, policy {policy}"
    return f"{Path(path).name}: {kind}, reduce {summary['reduce']}"


def plot(runs: list[str], out: str, labels: list[str] | None = None) -> Path:
    """Draw `runs` (the first is the reference) to the PNG `out`."""
    if not runs:
        raise UsageError("recover plot: name at least one run")
    if labels and len(labels) != len(runs):
        raise UsageError(f"recover plot: {len(labels)} labels for {len(runs)} runs")
    summaries = [load_summary(run, "plot") for run in runs]
    plt = _pyplot()
    fig = draw(plt, summaries, runs, labels)
    target = Path(out)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(target, dpi=110)
    except OSError as error:
        raise UsageError(f"recover plot: cannot write {target}: {error.strerror}") from None
    finally:
        plt.close(fig)
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
    bottom.legend(fontsize=8)
    strength.set_ylabel("live replicas")
    strength.set_xlabel("step")
    strength.yaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    return fig
