"""`recover plot` (cli/plot.py): the three-curve trajectory figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recover.cli import plot
from recover.cli.jobargs import UsageError
from recover.cli.main import main

STEPS = 6


def summary(losses: list[float], failures: list[int], policy: str = "recover",
            replicas: list[int] | None = None) -> dict:
    return {
        "replicas_per_step": replicas or [4] * STEPS,
        "steps_committed": STEPS, "reduce": "exact", "policy": policy,
        "microbatches_per_step": [8] * STEPS,
        "sample_digest_per_step": ["ab" * 32] * STEPS,
        "param_sha256_per_step": ["cd" * 32] * STEPS,
        "loss_per_step": losses,
        "failures": [{"step": s, "replica": 1, "phase": "backward"} for s in failures],
    }


REFERENCE = [4.0, 3.5, 3.1, 2.8, 2.6, 2.5]
DRIFTED = [4.0, 3.5, 3.2, 2.9, 2.7, 2.55]


def write_runs(tmp_path: Path) -> list[str]:
    runs = {"ref": summary(REFERENCE, []),
            "recover": summary(REFERENCE, [2, 4], replicas=[4, 4, 3, 4, 3, 3]),
            "drop": summary(DRIFTED, [2, 4], policy="drop")}
    paths = []
    for name, data in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(data))
        paths.append(str(tmp_path / name))
    return paths


def test_draws_three_curves_with_failures_marked(tmp_path):
    runs = write_runs(tmp_path)
    plt = plot._pyplot()
    fig = plot.draw(plt, [plot.load_summary(r) for r in runs], runs)
    try:
        top, bottom, strength = fig.axes
        assert [line.get_ydata().tolist() for line in top.get_lines() if len(line.get_ydata()) == STEPS] \
            == [REFERENCE, REFERENCE, DRIFTED]
        labels = [t.get_text() for t in top.get_legend().get_texts()]
        assert labels[0].startswith("ref: failure-free")
        assert "2 failures, policy recover" in labels[1] and "policy drop" in labels[2]
        # One x per failure of each failed run, at the failed step's loss.
        marks = [tuple(p) for c in top.collections for p in c.get_offsets().tolist()]
        assert sorted(marks) == sorted([(2, 3.1), (4, 2.6), (2, 3.2), (4, 2.7)])
        # The difference panel: ReCoVer sits on the floor, drop leaves it from the first failure.
        recovered, dropped = (line.get_ydata().tolist() for line in bottom.get_lines())
        assert recovered == [plot.FLOOR] * STEPS
        assert dropped[:2] == [plot.FLOOR] * 2 and all(d > 0.01 for d in dropped[2:])
        # Live replicas per step: capacity lost at a failure and back after a join.
        lines = [line.get_ydata().tolist() for line in strength.get_lines()]
        assert [4, 4, 3, 4, 3, 3] in [values[:STEPS] for values in lines]
    finally:
        plt.close(fig)


def test_cli_writes_a_png(tmp_path, capsys):
    runs = write_runs(tmp_path)
    out = tmp_path / "figs" / "trajectory.png"
    assert main(["plot", *runs, "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.strip() == f"wrote {out}"


@pytest.mark.parametrize(("case", "phrase"), [
    ("label-count", "labels for"), ("missing-run", "no run at"),
    ("unwritable", "file is a file, not a folder"), ("no-suffix", "name a .png file"),
    ("a-folder", "is a folder, not a file")])
def test_bad_input_is_one_line(tmp_path, capsys, case, phrase):
    runs = write_runs(tmp_path)
    argv = ["plot", *runs, "--out", str(tmp_path / "t.png")]
    if case == "label-count":
        argv += ["--label", "only one"]
    elif case == "missing-run":
        argv[1] = str(tmp_path / "nope")
    elif case == "unwritable":
        (tmp_path / "file").write_text("x")
        argv[-1] = str(tmp_path / "file" / "t.png")  # parent is a file
    elif case == "no-suffix":
        argv[-1] = str(tmp_path / "figure")  # matplotlib would write figure.png, not figure
    else:
        (tmp_path / "a.png").mkdir()
        argv[-1] = str(tmp_path / "a.png")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and err.startswith("recover plot"), err
    assert phrase in err, err
    assert not (tmp_path / "figure.png").exists()


def test_one_run_draws_without_a_warning(tmp_path, capsys):
    import warnings

    runs = write_runs(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels" would raise
        assert main(["plot", runs[0], "--out", str(tmp_path / "one.png")]) == 0


def test_no_runs_is_a_usage_error():
    with pytest.raises(UsageError, match="name at least one run"):
        plot.plot([], "x.png")


# ---------------------------------------------------------------- against wall time

def timed(failures: list[dict] | None = None, joins: list[dict] | None = None) -> dict:
    """A ReCoVer run of 12 steps, one every second from t=10 s, 100 tokens each."""
    base = summary([4.0 - 0.1 * s for s in range(12)], [], replicas=[4] * 5 + [3] * 3 + [4] * 4)
    base.update(steps_committed=12, committed_at_s_per_step=[10.0 + s for s in range(12)],
                tokens_per_step=[100] * 12, failures=failures or [], joins=joins or [])
    for key in ("microbatches_per_step", "sample_digest_per_step", "param_sha256_per_step"):
        base[key] = base[key][:1] * 12
    return base


def baseline() -> dict:
    """A ckpt-restart run: steps 0-5, a failure at 16.5 s, back from step 3 at 21 s."""
    timeline = [[10.0 + s, s] for s in range(6)] + [[21.0 + i, s] for i, s in enumerate(range(3, 12))]
    return {"mode": "ckpt-restart", "steps_committed": 12, "replicas": 4, "tokens": 1200,
            "loss_per_step": [4.0 - 0.1 * s for s in range(12)], "commit_timeline": timeline,
            "failures": [{"step": 6}], "attempts": [{"n": 0, "world": 4}, {"n": 1, "world": 4}],
            "restarts": [{"failed_at_s": 16.5, "restart_s": 4.5}]}


def test_a_recover_run_in_time_its_stall_its_join_and_its_rate() -> None:
    from recover.cli import timeline

    run = timeline.shifted(timeline.recover_timeline(timed(
        failures=[{"step": 5, "at_s": 14.5, "recovered_s": 0.05, "replica": 1}],
        joins=[{"replica": 4, "spare": False, "started_at_s": 16.0, "entered_at_s": 17.2}])))
    assert run.commits[0] == (0.0, 0) and run.commits[-1] == (11.0, 11)  # from the first commit
    assert run.stalls == [(4.5, 5.0)]  # the failure to the commit of the step it struck
    assert run.joins == [(6.0, pytest.approx(7.2))]
    assert run.replicas[:1] == [(0.0, 4)] and (5.0, 3) in run.replicas
    assert timeline.rates(run) == [(float(t), 500 / 5) for t in range(5, 12)]  # 100 tokens/s


def test_a_ckpt_restart_run_in_time_breaks_at_its_restart() -> None:
    from recover.cli import timeline

    run = timeline.shifted(timeline.baseline_timeline(baseline()))
    assert [len(part) for part in timeline.segments(run.commits)] == [6, 9]
    assert run.restarts == [(6.5, 11.0)]
    assert run.replicas == [(0.0, 4), (6.5, 0), (11.0, 4), (19.0, 4)]
    xs, ys = timeline.broken(run.commits, lambda step: step)
    gap = ys.index(next(y for y in ys if y != y))  # the NaN between the segments
    assert xs[gap] == 11.0 and ys[gap - 1] == 5 and ys[gap + 1] == 3  # work done again
    rates = timeline.rates(run)
    assert any(r != r for _, r in rates)  # no rate drawn across the restart


def test_the_time_figure_overlays_both_runs_with_their_shading(tmp_path) -> None:
    from recover.cli import timeline

    runs = []
    for name, data in (("recover", timed(
            failures=[{"step": 5, "at_s": 14.5, "recovered_s": 0.05, "replica": 1}],
            joins=[{"replica": 4, "spare": False, "started_at_s": 16.0, "entered_at_s": 17.2}])),
            ("ckpt", baseline())):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(data))
        runs.append(str(tmp_path / name))
    plt = plot._pyplot()
    summaries = [plot.load_run(r) for r in runs]
    fig = timeline.draw_timeline(plt, summaries, runs,
                                 [plot.label_of(s, r) for s, r in zip(summaries, runs, strict=True)])
    try:
        loss, steps, replicas, rate = fig.axes
        assert len(loss.get_lines()) == 2 and len(rate.get_lines()) == 2
        shaded = [t.get_text() for t in loss.get_legend().get_texts()]
        assert "recovery (failure to its step's commit)" in shaded
        assert "join (transfer to entry; a spare: its promotion)" in shaded and "checkpoint restart" in shaded
        assert any("checkpoint-and-restart" in s for s in shaded)  # the baseline's label
        assert rate.get_xlabel() == "seconds since the run's first commit"
    finally:
        plt.close(fig)
    out = tmp_path / "time.png"
    assert main(["plot", *runs, "--x", "time", "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_a_ckpt_restart_run_by_step_is_one_line(tmp_path, capsys) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "summary.json").write_text(json.dumps(baseline()))
    assert main(["plot", str(tmp_path / "ckpt"), "--out", str(tmp_path / "t.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "plot it with --x time" in err
