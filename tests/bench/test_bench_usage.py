"""Bad input to the new bench commands: one line on stderr, exit code 2, nothing run."""

from __future__ import annotations

import pytest

from recover.cli.main import main


@pytest.mark.parametrize("argv", [
    ["bench", "overhead", "--out", "{tmp}", "--steps", "4"],
    ["bench", "overhead", "--out", "{tmp}", "--kill", "step=1,replica=0,phase=forward"],
    ["bench", "overhead", "--out", "{tmp}", "--warmup", "0"],
    ["bench", "recovery", "--out", "{tmp}", "--replicas", "3"],
    ["bench", "recovery", "--out", "{tmp}", "--runs", "0"],
    ["bench", "recovery", "--out", "{tmp}", "--replicas", "20", "--microbatches", "16"],
    ["bench", "controller", "--out", "{tmp}", "--agents", "10,x"],
    ["bench", "controller", "--out", "{tmp}", "--agents", "0"],
    ["bench", "controller", "--out", "{tmp}", "--duration", "1"],
    ["bench", "controller"],
])
def test_bad_input_is_one_line_exit_2(argv, tmp_path, capsys):
    code = main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "results.json").exists()
