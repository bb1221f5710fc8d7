"""examples/hf_gpt2.py: a `transformers` GPT-2 on the standard library's sources, under kills.

Skipped, saying why, where `transformers` is not installed (the `hf` extra; the test
command installs it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import (
    REPO,
    assert_bitwise_identical,
    assert_same_training,
    run_recover,
)

pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[hf]'")
pytestmark = pytest.mark.slow

ARGS = ["--replicas", "3", "--steps", "5", "-M", "6", "--seed", "1", "--quiet"]
SCRIPT = ["--", "python", str(REPO / "examples" / "hf_gpt2.py"), "--seq-len", "32"]


def run(out: Path, *args: str) -> dict[str, Any]:
    # The agents' warm interpreters import GPT-2 once, not every worker and restart.
    result = run_recover(out, *ARGS, *args, *SCRIPT, timeout=240,
                         env={"RECOVER_PRELOAD": "transformers.models.gpt2.modeling_gpt2"})
    assert result.returncode == 0, result.stderr
    return result.summary


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_gpt2_keeps_its_trajectory_through_kills_in_every_phase(tmp_path: Path, mode: str) -> None:
    reference = run(tmp_path / "reference", "--reduce", mode)
    assert reference["tokens"] == 5 * 6 * 8 * 32  # reported by the example's loss function
    runs = [["step=1,replica=1,phase=forward", "step=3,replica=2,phase=reduce"],
            ["step=1,replica=2,phase=backward", "step=2,replica=0,phase=commit"]]
    for index, kills in enumerate(runs if mode == "exact" else runs[1:]):
        summary = run(tmp_path / f"killed-{index}", "--reduce", mode,
                      *[part for kill in kills for part in ("--kill", kill)])
        assert [f["phase"] for f in summary["failures"]] == [k.rsplit("=", 1)[1] for k in kills]
        if mode == "exact":
            assert_bitwise_identical(summary, reference)
        else:
            assert_same_training(summary, reference)
