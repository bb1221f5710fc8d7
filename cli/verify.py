"""`recover verify RUN_A RUN_B`: compare two runs' ledgers step by step.

For every committed step it compares the number of microbatches, the digest
of the sample ids consumed and the step digest after the step (parameters, and
the model's buffers when they are in the guarantee: `PARAMS+BUFFERS`, see
trainer/digest.py), and says where the runs first part and which of the two
differs. Runs in fast mode (`--reduce fast`) are not bitwise alike by design: with
`--loss-rtol` their parameters are not held against them. Exit 0: identical (or, in fast
mode with a tolerance, agreeing as it promises); 1: they differ; 2: bad input.
"""

from __future__ import annotations

import json
import math
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


LEDGER_KEYS = ("microbatches_per_step", "sample_digest_per_step", "param_sha256_per_step",
               "loss_per_step")
"""Per-step lists a summary must hold, one entry per committed step."""


def load_summary(path: str, command: str = "verify") -> dict[str, Any]:
    """Read and shape-check a run's summary.json; UsageError (one line) when it is not one.

    `command` names the `recover` subcommand in the error message.
    """
    candidate = Path(path)
    if candidate.is_dir():
        candidate = candidate / "summary.json"
    try:
        summary = json.loads(candidate.read_text())
    except FileNotFoundError:
        raise UsageError(f"recover {command}: no run at {path} (expected a run directory or "
                         "its summary.json)") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UsageError(f"recover {command}: {candidate} is not a summary.json") from None
    except OSError as error:
        raise UsageError(f"recover {command}: cannot read {candidate}: {error.strerror}") from None
    problem = _shape_problem(summary)
    if problem:
        raise UsageError(f"recover {command}: {candidate} is not a run summary: {problem}")
    return summary


def _shape_problem(summary: Any) -> str | None:
    if not isinstance(summary, dict):
        return f"expected a JSON object, found {type(summary).__name__}"
    steps = summary.get("steps_committed")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        return "no steps_committed count"
    for key in LEDGER_KEYS:
        values = summary.get(key)
        if not isinstance(values, list):
            return f"no {key} list"
        if len(values) < steps:
            return f"{key} has {len(values)} entries for {steps} committed steps"
    return None


def _short(value: Any) -> str:
    return value[:12] if isinstance(value, str) else str(value)


def _losses_agree(a: float | None, b: float | None, rtol: float) -> bool:
    """Symmetric relative tolerance; NaN never agrees (it means a run diverged)."""
    if a is None or b is None:  # json has no NaN of its own; a missing loss is not a match
        return a is b
    if math.isnan(a) or math.isnan(b):
        return False
    if a == b:  # covers equal infinities, which the difference below cannot
        return True
    return abs(a - b) <= rtol * max(abs(a), abs(b))


def _state_difference(left: Any, right: Any) -> str:
    """Which part of two step digests differs: the parameters, or (they agree) the buffers."""
    if not (isinstance(left, str) and isinstance(right, str)):
        return f"parameters {_short(left)} vs {_short(right)}"
    lp, _, lb = left.partition("+")
    rp, _, rb = right.partition("+")
    if lp != rp:
        return f"parameters {_short(lp)} vs {_short(rp)}"
    if bool(lb) != bool(rb):
        return ("buffers: one run's digests cover the model's buffers, the other's do not "
                "(buffers='local' or an older build); parameters agree")
    return f"buffers {_short(lb)} vs {_short(rb)} (parameters agree)"


def compare(a: dict[str, Any], b: dict[str, Any], loss_rtol: float = 0.0) -> Verdict:
    """Compare two summaries' ledgers; the first difference wins."""
    checks = [
        ("microbatches_per_step", "microbatches"),
        ("sample_digest_per_step", "sample digest"),
        ("param_sha256_per_step", "parameters"),
    ]
    # A summary without the key is an older build's: one sha256 stream.
    schemes = a.get("digest_scheme", "sha256"), b.get("digest_scheme", "sha256")
    unlike = None not in schemes and schemes[0] != schemes[1]
    if unlike:  # builds that hash parameters differently: their digests cannot be compared
        checks.pop()
    steps = min(a["steps_committed"], b["steps_committed"])
    # Fast mode promises the same microbatches and samples and the loss to float rounding,
    # not the same bits (its float32 sums follow who computed what): asked for a tolerance,
    # check that promise; asked for bits, say why they may differ.
    fast = "fast" in (a.get("reduce"), b.get("reduce"))
    rounded_at = None
    unrecorded: list[int] = []  # steps whose parameters a run did not record (it failed)
    if steps == 0:
        return Verdict(False, "nothing to compare: "
                              + ("neither run committed a step" if a["steps_committed"] ==
                                 b["steps_committed"] else "one run committed no step"), None)
    for step in range(steps):
        for key, what in checks:
            left, right = a[key][step], b[key][step]
            if what == "parameters" and (left is None or right is None):
                unrecorded.append(step)
                continue
            if left == right:
                continue
            if what == "parameters" and fast and loss_rtol > 0:
                rounded_at = step if rounded_at is None else rounded_at
                continue
            detail = (_state_difference(left, right) if what == "parameters"
                      else f"{what} {_short(left)} vs {_short(right)}")
            if what == "parameters" and fast:
                detail += (" (fast mode: equal up to summation order; --loss-rtol 1e-4 checks "
                           "what it promises, --reduce exact runs compare bitwise)")
            return Verdict(False, f"differ: first at step {step}: {detail}", step)
        la, lb = a["loss_per_step"][step], b["loss_per_step"][step]
        if not _losses_agree(la, lb, loss_rtol):
            return Verdict(False, f"differ: first at step {step}: loss {la!r} vs {lb!r}", step)
    if a["steps_committed"] != b["steps_committed"]:
        return Verdict(False, f"differ: {a['steps_committed']} vs {b['steps_committed']} committed "
                              f"steps (the first {steps} agree)", None)
    if unlike:
        return Verdict(False, f"parameters not compared: one run's digests are {schemes[0]}, the "
                              f"other's {schemes[1]} (builds that hash them differently); the "
                              f"{steps} steps' microbatches, samples and loss agree", None)
    if unrecorded:  # not a proof of sameness, nor a difference: said as what it is
        return Verdict(False, f"not all compared: {steps} steps agree where both runs recorded "
                              f"them, but {_state_word(a, steps)} were not recorded by a run at "
                              f"step{'s' if len(unrecorded) > 1 else ''} "
                              f"{', '.join(map(str, unrecorded))}", None)
    if rounded_at is not None:
        return Verdict(True, f"agree as fast mode promises: {steps} steps with the same "
                             f"microbatches and samples, the loss within a relative {loss_rtol:g}; "
                             f"{_state_word(a, steps)} differ from step {rounded_at} (fast mode's "
                             "float32 sums follow who computed what; --reduce exact runs compare "
                             "bitwise)", None)
    return Verdict(True, f"identical: {steps} steps with the same microbatches, samples, loss and "
                         f"{_state_word(a, steps)} after every step", None)


def _state_word(summary: dict[str, Any], steps: int) -> str:
    digests = summary["param_sha256_per_step"][:steps]
    return ("parameters and buffers" if any(isinstance(d, str) and "+" in d for d in digests)
            else "parameters")


def main(run_a: str, run_b: str, loss_rtol: float) -> int:
    if not (loss_rtol >= 0.0 and math.isfinite(loss_rtol)):
        raise UsageError(f"recover verify: --loss-rtol must be a finite number >= 0, got {loss_rtol}")
    verdict = compare(load_summary(run_a), load_summary(run_b), loss_rtol)
    print(verdict.message)
    return 0 if verdict.identical else 1
