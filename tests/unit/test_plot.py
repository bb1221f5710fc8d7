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


@pytest.mark.parametrize("case", ["label-count", "missing-run", "unwritable"])
def test_bad_input_is_one_line(tmp_path, capsys, case):
    runs = write_runs(tmp_path)
    argv = ["plot", *runs, "--out", str(tmp_path / "t.png")]
    if case == "label-count":
        argv += ["--label", "only one"]
    elif case == "missing-run":
        argv[1] = str(tmp_path / "nope")
    else:
        (tmp_path / "file").write_text("x")
        argv[-1] = str(tmp_path / "file" / "t.png")  # parent is a file
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and err.startswith("recover plot"), err


def test_no_runs_is_a_usage_error():
    with pytest.raises(UsageError, match="name at least one run"):
        plot.plot([], "x.png")
