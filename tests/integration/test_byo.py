"""Bring your own training: a user's script under `recover run`, real processes, real kills.

The script is examples/minimal.py (public imports only). In exact mode its
parameters after every step are bitwise those of its failure-free run, with
workers SIGKILLed in forward, backward, reduce and commit; in fast mode its
ledger is identical and its loss within 1e-4; bf16 works in both modes; the
epoch sampler's ledger covers the dataset once per epoch through failures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from recover.trainer import EpochSampler
from tests.integration.conftest import (
    REPO,
    assert_bitwise_identical,
    assert_same_training,
    run_recover,
)

pytestmark = pytest.mark.slow

MINIMAL = ["--", "python", str(REPO / "examples" / "minimal.py")]
ARGS = ["--replicas", "4", "--steps", "8", "-M", "12", "--seed", "3", "--quiet"]


def run(out: Path, *args: str, script: list[str] = MINIMAL) -> dict[str, Any]:
    result = run_recover(out, *ARGS, *args, *script)
    assert result.returncode == 0, result.stderr
    return result.summary


def kills(*specs: str) -> list[str]:
    return [part for spec in specs for part in ("--kill", spec)]


@pytest.fixture(scope="module")
def exact_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    summary = run(tmp_path_factory.mktemp("minimal-exact"), "--reduce", "exact")
    assert summary["failures"] == []
    assert summary["workload"]["determinism_sha256"]  # checked by default in exact mode
    assert summary["microbatch_size"] == 16
    return summary


@pytest.mark.parametrize("specs", [
    pytest.param(["step=1,replica=1,phase=forward", "step=3,replica=2,phase=reduce"],
                 id="forward+reduce"),
    pytest.param(["step=2,replica=3,phase=backward", "step=4,replica=0,phase=commit"],
                 id="backward+commit"),
])
def test_minimal_example_is_bitwise_through_kills(tmp_path: Path, specs: list[str],
                                                  exact_reference: dict[str, Any]) -> None:
    summary = run(tmp_path, "--reduce", "exact", *kills(*specs))
    assert len(summary["failures"]) == 2
    assert_bitwise_identical(summary, exact_reference)


def test_minimal_example_in_fast_mode_keeps_ledger_and_loss(tmp_path: Path) -> None:
    reference = run(tmp_path / "reference")
    summary = run(tmp_path / "killed", *kills("step=2,replica=1,phase=backward",
                                              "step=5,replica=3,phase=reduce"))
    assert len(summary["failures"]) == 2
    assert_same_training(summary, reference)


def test_a_bf16_model_trains_in_both_modes(tmp_path: Path) -> None:
    bf16 = [*MINIMAL, "--dtype", "bfloat16"]
    reference = run(tmp_path / "exact-reference", "--reduce", "exact", script=bf16)
    assert reference["workload"]["gradient_buckets"] == ["cpu bfloat16 x 321"]
    exact = run(tmp_path / "exact", "--reduce", "exact",
                *kills("step=2,replica=1,phase=backward"), script=bf16)
    assert_bitwise_identical(exact, reference)
    fast = run(tmp_path / "fast", *kills("step=3,replica=2,phase=reduce"), script=bf16)
    assert fast["state"] == "succeeded" and len(fast["failures"]) == 1
    assert fast["microbatches_per_step"] == [12] * 8
    assert fast["sample_digest_per_step"] == reference["sample_digest_per_step"]


def test_epoch_sampler_covers_the_dataset_once_per_epoch_through_failures(tmp_path: Path) -> None:
    # 4096 samples, 32 microbatches of 16 a step: epochs are steps 0-7, 8-15, 16-23.
    summary = run_recover(tmp_path, "--replicas", "3", "--steps", "20", "-M", "32", "--seed", "9",
                          "--quiet", "--record-sample-ids",
                          *kills("step=6,replica=1,phase=backward", "step=9,replica=2,phase=reduce"),
                          *MINIMAL)
    assert summary.returncode == 0, summary.stderr
    ledger = summary.summary["sample_ids_per_step"]
    assert len(ledger) == 20 and len(summary.summary["failures"]) == 2
    for epoch in range(2):
        ids = [i for step in range(8 * epoch, 8 * epoch + 8) for i in ledger[step]]
        assert sorted(ids) == list(range(4096)), f"epoch {epoch} repeats or misses samples"
    partial = [i for step in range(16, 20) for i in ledger[step]]
    assert len(set(partial)) == len(partial) == 4 * 512
    sampler = EpochSampler(4096, 16, 32, seed=9)
    assert ledger[13] == sorted(i for mb in range(32) for i in sampler.sample_ids(13, mb))
