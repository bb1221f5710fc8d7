"""`recover plot --x time`: runs against wall time, what a person watching a job wants.

Four panels share the time axis: loss, steps committed, live replicas and tokens/s. Time
counts from each run's first commit, so runs line up however long their processes took to
start (a checkpoint-and-restart run pays its startup again at every restart, and that
shows). Shaded: each recovery from the failure to the commit of the step it struck (red);
each join from its state transfer's start to the replica's entry (green; a hot spare's
promotion as a line); a checkpoint-and-restart run's restarts from the failure to its first
commit again (orange), where its steps-committed curve falls back to the checkpoint it
resumed from (work done twice).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WINDOW = 5
"""Steps per tokens/s point (a rolling rate: one step's time is noisy)."""

STALL, JOIN, RESTART = "tab:red", "tab:green", "tab:orange"


@dataclass
class Timeline:
    """One run as points in time (seconds since its start)."""
    commits: list[tuple[float, int]]
    """(time, step) of every commit, re-done steps included."""
    losses: list[float]
    """Loss per step (the last commit of a re-done step)."""
    replicas: list[tuple[float, int]]
    """(time, live replicas) where the count changes or a step commits."""
    tokens_per_step: list[int]
    stalls: list[tuple[float, float]] = field(default_factory=list)
    joins: list[tuple[float, float]] = field(default_factory=list)
    restarts: list[tuple[float, float]] = field(default_factory=list)


def recover_timeline(summary: dict[str, Any]) -> Timeline:
    times = summary.get("committed_at_s_per_step") or []
    steps = [(t, step) for step, t in enumerate(times) if t is not None]
    committed = dict((step, t) for t, step in steps)
    replicas = summary.get("replicas_per_step") or []
    stalls = []
    for failure in summary["failures"]:
        start = failure.get("at_s")
        if start is None:
            continue
        end = committed.get(failure["step"], start + (failure.get("recovered_s") or 0.0))
        stalls.append((start, max(end, start)))
    # A hot spare's join began long before it was needed: only its promotion is drawn.
    joins = [(j["entered_at_s"] if j.get("spare") else j["started_at_s"], j["entered_at_s"])
             for j in summary.get("joins") or []]
    tokens = summary.get("tokens_per_step") or \
        [summary.get("tokens", 0) // max(summary["steps_committed"], 1)] * len(times)
    return Timeline(steps, summary["loss_per_step"],
                    [(t, replicas[s]) for t, s in steps if s < len(replicas)],
                    tokens, stalls, joins)


def baseline_timeline(summary: dict[str, Any]) -> Timeline:
    """A `recover run --mode ckpt-restart` run: its commits, and its restarts (the whole job
    stops at a failure and starts again from the newest checkpoint)."""
    commits = [(float(t), int(step)) for t, step in summary["commit_timeline"]]
    restarts = [(r["failed_at_s"], r["failed_at_s"] + (r.get("restart_s") or 0.0))
                for r in summary.get("restarts", [])]
    worlds = [a["world"] for a in summary.get("attempts", [])] or [summary["replicas"]]
    replicas: list[tuple[float, int]] = [(0.0, worlds[0])]
    for index, (stopped, started) in enumerate(restarts):
        replicas += [(stopped, 0), (started, worlds[min(index + 1, len(worlds) - 1)])]
    end = commits[-1][0] if commits else 0.0
    replicas.append((end, replicas[-1][1]))
    per_step = summary.get("tokens", 0) // max(summary["steps_committed"], 1)
    return Timeline(commits, summary["loss_per_step"], replicas,
                    [per_step] * (max((s for _, s in commits), default=-1) + 1),
                    restarts=restarts)


def segments(commits: list[tuple[float, int]]) -> list[list[tuple[float, int]]]:
    """The commits cut where the step goes back (a restart from a checkpoint): lines are
    drawn within a segment, never across a restart."""
    cut: list[list[tuple[float, int]]] = []
    for commit in commits:
        if not cut or commit[1] <= cut[-1][-1][1]:
            cut.append([])
        cut[-1].append(commit)
    return cut


def rates(timeline: Timeline) -> list[tuple[float, float]]:
    """Tokens per second over the last WINDOW commits, at each commit; NaN between
    segments (a restart), so no line crosses one."""
    points: list[tuple[float, float]] = []
    for part in segments(timeline.commits):
        if points:
            points.append((part[0][0], float("nan")))
        for index in range(WINDOW, len(part)):
            (before, _), (now, _) = part[index - WINDOW], part[index]
            tokens = sum(timeline.tokens_per_step[step] for _, step in part[index - WINDOW + 1:
                                                                              index + 1]
                         if step < len(timeline.tokens_per_step))
            if now > before:
                points.append((now, tokens / (now - before)))
    return points


def shifted(timeline: Timeline) -> Timeline:
    """The timeline with its first commit at time 0."""
    origin = timeline.commits[0][0] if timeline.commits else 0.0

    def move(pairs: list[tuple[float, Any]]) -> list[tuple[float, Any]]:
        return [(t - origin, v) for t, v in pairs]

    def spans(pairs: list[tuple[float, float]]) -> list[tuple[float, float]]:
        return [(start - origin, end - origin) for start, end in pairs]

    # Replicas from before the first commit (the processes starting) are not drawn.
    replicas = move(timeline.replicas)
    before = [n for t, n in replicas if t <= 0]
    replicas = ([(0.0, before[-1])] if before else []) + [(t, n) for t, n in replicas if t > 0]
    return Timeline(move(timeline.commits), timeline.losses, replicas, timeline.tokens_per_step,
                    spans(timeline.stalls), spans(timeline.joins), spans(timeline.restarts))


def broken(commits: list[tuple[float, int]], value: Any) -> tuple[list[float], list[float]]:
    """x and y of `value(step)` per commit, with a NaN gap at each restart."""
    xs: list[float] = []
    ys: list[float] = []
    for part in segments(commits):
        if xs:
            xs.append(part[0][0])
            ys.append(float("nan"))
        xs += [t for t, _ in part]
        ys += [value(step) for _, step in part]
    return xs, ys


def draw_timeline(plt: Any, summaries: list[dict[str, Any]], runs: list[str],
                  labels: list[str]) -> Any:
    """The figure; `labels`: one legend entry per run."""
    fig, axes = plt.subplots(4, 1, figsize=(10, 10), sharex=True,
                             gridspec_kw={"height_ratios": [2.2, 1.6, 1.2, 1.6]})
    loss_ax, steps_ax, replicas_ax, rate_ax = axes
    shaded: set[str] = set()
    for index, summary in enumerate(summaries):
        baseline = summary.get("mode") == "ckpt-restart"
        timeline = shifted(baseline_timeline(summary) if baseline else recover_timeline(summary))
        label = labels[index]
        width = 2.2 - 0.5 * min(index, 2)
        times = [t for t, _ in timeline.commits]
        (line,) = loss_ax.plot(*broken(timeline.commits, timeline.losses.__getitem__),
                               label=label, linewidth=width)
        color = line.get_color()
        steps_ax.step(*broken(timeline.commits, lambda step: step + 1), where="post",
                      color=color, linewidth=width)
        replicas_ax.step([t for t, _ in timeline.replicas], [n for _, n in timeline.replicas],
                         where="post", color=color, linewidth=width)
        rate = rates(timeline)
        rate_ax.plot([t for t, _ in rate], [r for _, r in rate], color=color, linewidth=width)
        kinds = ((timeline.stalls, STALL, "recovery (failure to its step's commit)"),
                 (timeline.joins, JOIN, "join (transfer to entry; a spare: its promotion)"),
                 (timeline.restarts, RESTART, "checkpoint restart"))
        for spans, shade, what in kinds:
            for start, end in spans:
                for ax in axes:  # at least a hair's width: a recovery can take milliseconds
                    ax.axvspan(start, max(end, start + 0.002 * (times[-1] if times else 1)),
                               color=shade, alpha=0.18, linewidth=0,
                               label=what if ax is loss_ax and what not in shaded else None)
                shaded.add(what)
    loss_ax.set_ylabel("loss")
    loss_ax.set_title("against wall time" + (f" ({len(runs)} runs)" if len(runs) > 1 else
                                             f": {Path(runs[0]).name}"))
    loss_ax.legend(fontsize=8, loc="upper right")
    steps_ax.set_ylabel("steps committed")
    replicas_ax.set_ylabel("live replicas")
    replicas_ax.yaxis.get_major_locator().set_params(integer=True)
    replicas_ax.set_ylim(bottom=0)
    rate_ax.set_ylabel(f"tokens/s\n(over {WINDOW} steps)")
    rate_ax.set_xlabel("seconds since the run's first commit")
    rate_ax.set_ylim(bottom=0)
    fig.tight_layout()
    return fig
