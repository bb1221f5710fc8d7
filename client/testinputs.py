"""The checks of the testing settings' specs (`--kill`, `--slowdown`): each a one-line
message for a bad spec, or None (client/jobsettings.py runs them with the other checks)."""

from __future__ import annotations

import argparse

from recover.trainer.faults import ANY_REPLICA_PHASES, FaultSpecError, parse_fault_spec
from recover.trainer.slowdown import SlowdownSpecError, overlap, parse_slowdown_spec


def check_kills(texts: list[str], args: argparse.Namespace) -> str | None:
    for text in texts:
        try:
            spec = parse_fault_spec(text)
        except FaultSpecError as exc:
            return str(exc)
        if spec.step >= args.steps:
            return (f"--kill {text!r}: step {spec.step} is beyond the last step "
                    f"({args.steps - 1})")
        if spec.replica >= args.replicas and spec.phase not in ANY_REPLICA_PHASES:
            return (f"--kill {text!r}: replica {spec.replica} does not exist "
                    f"(replicas are 0..{args.replicas - 1})")
        if spec.rank >= args.ranks_per_replica:
            return (f"--kill {text!r}: rank {spec.rank} does not exist (a replica has "
                    f"{args.ranks_per_replica} rank{'s' if args.ranks_per_replica > 1 else ''}, "
                    "--ranks-per-replica)")
    return None


def check_slowdowns(texts: list[str], args: argparse.Namespace) -> str | None:
    specs = []
    for text in texts:
        try:
            spec = parse_slowdown_spec(text)
        except SlowdownSpecError as exc:
            return str(exc)
        if spec.from_step >= args.steps:
            return (f"--slowdown {text!r}: from_step {spec.from_step} is beyond the last step "
                    f"({args.steps - 1})")
        specs.append(spec)
    if (found := overlap(specs)) is not None:
        first, second = (texts[i] for i in found)
        return (f"--slowdown {first!r} and {second!r} slow replica {specs[found[0]].replica} "
                "in the same steps: give each step one factor")
    return None
