"""`recover bench recovery | overhead | controller`: flags, validation, tables.

    recover bench recovery --out DIR [--runs N] [--replicas R] [--microbatches M]
    recover bench overhead --out DIR [--replicas R] [-M M] [--steps T] [--reps K] [--torchft DIR]
    recover bench controller --out DIR [--agents N1,N2,...] [--duration S] [--relays K]
                             [--sim-racks K] [--kills K]

The work lives in recover.bench; bad input is a UsageError (one line, exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from recover.cli.jobargs import UsageError, add_job_arguments, job_from_args, positive_int
from recover.proto import pb


def out_dir(path: str) -> Path:
    """Create --out DIR; a UsageError (one line, exit 2) when it cannot be."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {path!r}: {exc.strerror}") from None
    return out


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def reference_job(args: argparse.Namespace, who: str) -> pb.JobConfig:
    """The job of the flags, checked to run the built-in reference GPT: the baselines
    re-implement its training loop, so a worker command of the user's own (from a job
    file) is a UsageError naming `who`, before anything starts."""
    from recover.bench.reference import NotReferenceGPT, reference_config

    job = job_from_args(args)
    try:
        reference_config(job, who)
    except NotReferenceGPT as exc:
        raise UsageError(str(exc)) from None
    return job


MAX_AGENT_CLIENTS = 5000
"""Agents with sessions of their own (a gRPC client each, on this machine) at most."""
MAX_SIMULATED_AGENTS = 100_000
"""Agents behind simulated racks at most (`--sim-racks`)."""


def _agent_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N1,N2,... whole numbers, got {text!r}"
                                         ) from None
    if not counts or any(not 1 <= n <= MAX_SIMULATED_AGENTS for n in counts):
        raise argparse.ArgumentTypeError(f"agent counts must be 1..{MAX_SIMULATED_AGENTS}, "
                                         f"got {text!r}")
    return counts


def add_parsers(kinds: Any) -> None:
    rec = kinds.add_parser("recovery", help="recovery latency over >= 100 injected failures, "
                                            "split by phase")
    rec.add_argument("--out", required=True, metavar="DIR")
    rec.add_argument("--runs", type=positive_int, default=34,
                     help="runs of 3 kills each (default 34: 102 failures, enough for a p99; "
                          "about 5 minutes)")
    rec.add_argument("--replicas", "-R", type=positive_int, default=4,
                     help="replicas per run, at least 4 (default 4)")
    rec.add_argument("--run-timeout", type=float, default=90.0, help="seconds per run (default 90)")
    rec.add_argument("--microbatches", "-M", type=positive_int, default=None,
                     help="M per step (default: 16, or the replicas if more)")
    ovh = kinds.add_parser("overhead", help="failure-free step time: ReCoVer fast/exact vs "
                                            "torch DDP")
    add_job_arguments(ovh, command=False)
    ovh.set_defaults(steps=40)
    ovh.add_argument("--out", required=True, metavar="DIR")
    ovh.add_argument("--reps", type=positive_int, default=3, help="runs per mode (default 3)")
    ovh.add_argument("--warmup", type=int, default=5, help="steps skipped per run (default 5)")
    ovh.add_argument("--run-timeout", type=float, default=300.0,
                     help="seconds per run (default 300)")
    ovh.add_argument("--torchft", default="", metavar="DIR",
                     help="also train the job with torchft 0.2, installed apart in DIR (pip "
                          "install --no-deps --target DIR torchft==0.2.0, and its "
                          "opentelemetry requirements): its failure-free step as a fourth mode")
    ctl = kinds.add_parser("controller", help="one controller under N simulated agents")
    ctl.add_argument("--out", required=True, metavar="DIR")
    ctl.add_argument("--agents", type=_agent_counts, default=[10, 100, 500, 1000],
                     metavar="N1,N2,...", help="agent counts to try (default 10,100,500,1000)")
    ctl.add_argument("--duration", type=float, default=15.0,
                     help="seconds of steady heartbeats measured per count (default 15)")
    ctl.add_argument("--relays", type=int, default=0,
                     help="agents reach the controller through this many relays (`recover "
                          "relay`, one per rack; 0: directly, the default)")
    ctl.add_argument("--sim-racks", type=int, default=0, metavar="K",
                     help="simulate K racks: streams speaking the relay protocol for their "
                          "agents, so the leader is measured at sizes whose agents and relays "
                          "this machine cannot host; with --relays R, R real relays carry 250 "
                          "real agents' sessions each and the racks the rest")
    ctl.add_argument("--kills", type=int, default=1,
                     help="agents killed one after another, each reaction timed (default 1)")


def _write(out: Path, results: dict[str, Any]) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")


def _overhead(args: argparse.Namespace) -> int:
    from recover.bench import overhead
    from recover.bench.torchft_job import torchft_missing

    if args.kill:
        raise UsageError("recover bench overhead: failure-free only, no --kill")
    if args.slowdown:
        raise UsageError("recover bench overhead: the DDP baseline does not emulate --slowdown")
    if args.warmup < 1:
        raise UsageError(f"--warmup must be at least 1, got {args.warmup}")
    if args.steps < args.warmup + 3:
        raise UsageError(f"--steps ({args.steps}) must be at least --warmup + 3 "
                         f"({args.warmup + 3})")
    if args.torchft and (why := torchft_missing(args.torchft)):
        raise UsageError(why)
    job = reference_job(args, "recover bench overhead")
    config = overhead.OverheadConfig(job=job, out=out_dir(args.out), reps=args.reps,
                                     warmup=args.warmup, timeout_s=args.run_timeout,
                                     torchft=args.torchft)
    try:
        results = overhead.run(config, say)
    except overhead.JobFailed as exc:
        print(f"recover bench overhead: {exc}", file=sys.stderr)
        return 1
    _write(config.out, results)
    print(overhead.format_table(results))
    print(f"results: {config.out / 'results.json'}")
    return 0


def _recovery(args: argparse.Namespace) -> int:
    from recover.bench import recovery

    if args.replicas < 4:
        raise UsageError(f"--replicas must be at least 4 (3 kills per run, one survivor), "
                         f"got {args.replicas}")
    microbatches = args.microbatches or max(16, args.replicas)
    if microbatches < args.replicas:
        raise UsageError(f"--microbatches must be at least --replicas ({args.replicas}), "
                         f"got {microbatches}")
    out = out_dir(args.out)
    results = recovery.run(recovery.RecoveryConfig(
        runs=args.runs, replicas=args.replicas, out=out, timeout_s=args.run_timeout,
        global_microbatches=microbatches), say)
    _write(out, results)
    print(recovery.format_table(results))
    print(f"results: {out / 'results.json'}")
    return 0 if not results["failed_runs"] else 1


def _controller(args: argparse.Namespace) -> int:
    from recover.bench import controller_scale, scale_results

    if not 3 <= args.duration <= 600:
        raise UsageError(f"--duration must be 3..600 seconds, got {args.duration}")
    if not 0 <= args.relays <= 1000:
        raise UsageError(f"--relays must be 0..1000, got {args.relays}")
    if not 0 <= args.sim_racks <= 1000:
        raise UsageError(f"--sim-racks must be 0..1000, got {args.sim_racks}")
    if not args.sim_racks and max(args.agents) > MAX_AGENT_CLIENTS:
        raise UsageError(f"--agents: at most {MAX_AGENT_CLIENTS} agents with sessions of their "
                         f"own, got {max(args.agents)}; larger counts with --sim-racks")
    behind_relays = args.relays * controller_scale.AGENTS_PER_PROCESS if args.sim_racks else 0
    if args.sim_racks and min(args.agents) < args.sim_racks + behind_relays:
        raise UsageError(f"--sim-racks {args.sim_racks}: every agent count must be at least the "
                         f"racks{f' and the {behind_relays} agents of the relays' if behind_relays else ''}"
                         f", got {min(args.agents)}")
    if not 1 <= args.kills <= 1000:
        raise UsageError(f"--kills must be 1..1000, got {args.kills}")
    if args.kills >= min(args.agents):
        raise UsageError(f"--kills {args.kills} must leave a survivor of the smallest count "
                         f"({min(args.agents)} agents)")
    out = out_dir(args.out)
    results = controller_scale.run(controller_scale.ScaleConfig(
        agents=args.agents, duration_s=args.duration, out=out, relays=args.relays,
        sim_racks=args.sim_racks, kills=args.kills), say)
    _write(out, results)
    print(scale_results.format_table(results))
    print(f"results: {out / 'results.json'}")
    return 0


def main(args: argparse.Namespace) -> int:
    return {"recovery": _recovery, "overhead": _overhead, "controller": _controller}[args.bench](args)
