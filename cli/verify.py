"""`recover verify RUN_A RUN_B`: compare two runs' ledgers step by step.

For every committed step it compares the number of microbatches, the digest
of the sample ids consumed and the parameter digest after the step, and says
where the runs first part. Exit 0: identical; 1: they differ; 2: bad input.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recover.cli.jobargs import UsageError


@dataclass(frozen=True)
class Verdict:
    identical: bool
    message: str
    first_difference: int | None
    """The first step that differs (None when identical or when only lengths differ)."""


def load_summary(path: str) -> dict[str, Any]:
    candidate = Path(path)
    if candidate.is_dir():
        candidate = candidate / "summary.json"
    try:
        return json.loads(candidate.read_text())
    except FileNotFoundError:
        raise UsageError(f"recover verify: no run at {path} (expected a run directory or "
                         "its summary.json)") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UsageError(f"recover verify: {candidate} is not a summary.json") from None


def _short(value: Any) -> str:
    return value[:12] if isinstance(value, str) else str(value)


def compare(a: dict[str, Any], b: dict[str, Any], loss_rtol: float = 0.0) -> Verdict:
    """Compare two summaries' ledgers; the first difference wins."""
    checks = (
        ("microbatches_per_step", "microbatches"),
        ("sample_digest_per_step", "sample digest"),
        ("param_sha256_per_step", "parameters"),
    )
    steps = min(a["steps_committed"], b["steps_committed"])
    for step in range(steps):
        for key, what in checks:
            left, right = a[key][step], b[key][step]
            if left != right:
                return Verdict(False, f"differ: first at step {step}: {what} "
                                      f"{_short(left)} vs {_short(right)}", step)
        la, lb = a["loss_per_step"][step], b["loss_per_step"][step]
        if abs(la - lb) > loss_rtol * abs(la):
            return Verdict(False, f"differ: first at step {step}: loss {la!r} vs {lb!r}", step)
    if a["steps_committed"] != b["steps_committed"]:
        return Verdict(False, f"differ: {a['steps_committed']} vs {b['steps_committed']} committed "
                              f"steps (the first {steps} agree)", None)
    return Verdict(True, f"identical: {steps} steps with the same microbatches, samples, loss and "
                         "parameters after every step", None)


def main(run_a: str, run_b: str, loss_rtol: float) -> int:
    verdict = compare(load_summary(run_a), load_summary(run_b), loss_rtol)
    print(verdict.message)
    return 0 if verdict.identical else 1
