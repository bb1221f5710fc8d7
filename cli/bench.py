"""`recover bench ...` and `recover run --mode ckpt-restart`: the benchmark entry points.

    recover bench throughput --schedule FILE --out DIR   ReCoVer vs ckpt-restart vs failure-free
    recover bench simulate --out DIR                     discrete-event projection at scale
    recover bench recovery | overhead | controller       (cli/bench_more.py)

The work lives in recover.bench; this module only parses and validates flags
(one-line errors, exit code 2) and prints tables.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
from pathlib import Path
from typing import Any

from recover.cli import bench_more
from recover.cli.bench_more import out_dir as _out
from recover.cli.bench_more import reference_job, say
from recover.cli.jobargs import UsageError, add_job_arguments


def _policy_args(parser: argparse.ArgumentParser) -> None:
    ckpt = parser.add_argument_group("checkpoint-and-restart baseline (recover run: with "
                                     "--mode ckpt-restart only)")
    ckpt.add_argument("--ckpt-every-steps", type=int, default=None, metavar="N",
                      help="checkpoint every N steps (default: Young-Daly from the measured write "
                           "cost and the schedule's failure rate)")
    ckpt.add_argument("--ckpt-every-s", type=float, default=None, metavar="S",
                      help="checkpoint every S seconds")
    ckpt.add_argument("--mtbf", type=float, default=None, metavar="S",
                      help="job-wide mean time between failures for Young-Daly (default: from "
                           "the schedule)")


def add_run_mode_arguments(run: argparse.ArgumentParser) -> None:
    """`recover run --mode ckpt-restart [--schedule FILE] [--ckpt-every-steps N ...]`."""
    run.add_argument("--mode", choices=["recover", "ckpt-restart"], default="recover",
                     help="recover (default) or the checkpoint-and-restart baseline "
                          "(torchrun-style: any failure restarts every worker from the last "
                          "checkpoint)")
    run.add_argument("--schedule", default=None, metavar="FILE",
                     help="ckpt-restart only: slot failures from a schedule file "
                          "(bench/schedules/)")
    _policy_args(run)


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks: throughput, recovery, overhead, controller, simulator")
    kinds = bench.add_subparsers(dest="bench", metavar="BENCH", parser_class=type(bench))
    kinds.required = True
    tp = kinds.add_parser("throughput", help="ReCoVer vs ckpt-restart vs failure-free, same job "
                                             "and failure schedule")
    add_job_arguments(tp, command=False)
    tp.set_defaults(steps=40, compute_ms=100.0)
    tp.add_argument("--schedule", required=True, metavar="FILE", help="failure schedule (JSON)")
    tp.add_argument("--out", required=True, metavar="DIR", help="results.json, PNGs, run folders")
    tp.add_argument("--run-timeout", type=float, default=600.0, help="seconds per run (default 600)")
    _policy_args(tp)
    sim = kinds.add_parser("simulate", help="discrete-event projection to 512 / 16k / 100k GPUs")
    sim.add_argument("--out", required=True, metavar="DIR")
    sim.add_argument("--calibrate", default=None, metavar="RESULTS",
                     help="a `bench throughput` results.json to calibrate against")
    sim.add_argument("--seed", type=int, default=0)
    bench_more.add_parsers(kinds)


def _policy(args: argparse.Namespace, schedule_mtbf: float | None) -> Any:
    from recover.bench.ckpt_policy import CheckpointPolicy

    if args.ckpt_every_steps is not None and args.ckpt_every_steps < 1:
        raise UsageError(f"--ckpt-every-steps must be at least 1, got {args.ckpt_every_steps}")
    for flag, value in (("--ckpt-every-s", args.ckpt_every_s), ("--mtbf", args.mtbf)):
        if value is not None and not 0 < value < math.inf:
            raise UsageError(f"{flag} must be a positive number of seconds, got {value}")
    return CheckpointPolicy(every_steps=args.ckpt_every_steps, every_s=args.ckpt_every_s,
                            system_mtbf_s=args.mtbf or schedule_mtbf)


def _schedule(path: str | None, replicas: int) -> Any:
    from recover.bench.schedules import ScheduleError, load

    if path is None:
        return None
    try:
        return load(path, replicas)
    except ScheduleError as exc:
        raise UsageError(str(exc)) from None


def run_ckpt_restart(args: argparse.Namespace) -> int:
    """`recover run --mode ckpt-restart`."""
    from recover.bench.ckpt_restart import CkptRestartConfig, run

    job = reference_job(args, "recover run --mode ckpt-restart")
    if job.reduce != "fast" or job.policy == "drop":
        # Restarts plan every replica alike (no failure is ever recovered inside a step):
        # the default policy is fine, dropping microbatches is not what a restart does.
        raise UsageError("--mode ckpt-restart supports --reduce fast and not --policy drop")
    faults = job.testing.faults
    crashes = [f for f in faults if f.phase in ("forward", "backward", "reduce", "commit")]
    if len(crashes) != len(faults):
        raise UsageError("--mode ckpt-restart: --kill supports the crash phases forward, backward, "
                         "reduce and commit only (the process is SIGKILLed during that step)")
    if job.testing.slowdowns:
        raise UsageError("--mode ckpt-restart does not emulate --slowdown")
    schedule = _schedule(args.schedule, job.replicas)
    policy = _policy(args, schedule.system_mtbf_s() if schedule else None)
    out = _out(args.out)
    summary = run(CkptRestartConfig(job=job, out=out, policy=policy, schedule=schedule,
                                    step_kills=[(f.step, f.replica) for f in faults],
                                    progress=None if args.quiet else say))
    print(f"{summary['state']}: {summary['steps_committed']}/{summary['steps_requested']} steps, "
          f"{len(summary['restarts'])} restarts, {summary['steps_redone']} steps redone, "
          f"{len(summary['checkpoints'])} checkpoints, {summary['wall_s']:.1f}s")
    print(f"summary: {out / 'summary.json'}")
    return 0 if summary["state"] == "succeeded" else 1


def _throughput(args: argparse.Namespace) -> int:
    from recover.bench import throughput
    from recover.bench.recover_job import JobFailed

    if args.kill:
        raise UsageError("recover bench throughput: failures come from --schedule, not --kill")
    if args.slowdown:
        raise UsageError("recover bench throughput: the ckpt-restart baseline does not emulate "
                         "--slowdown")
    job = reference_job(args, "recover bench throughput")
    if job.reduce != "fast" or job.policy == "drop":
        raise UsageError("recover bench throughput: the baseline supports --reduce fast and "
                         "not --policy drop")
    # The baseline plans every replica alike; so does ReCoVer's run of the same job (uniform
    # quotas, the count policy), or the two would not sum the same floats in the same order.
    job.policy = "recover"
    schedule = _schedule(args.schedule, job.replicas)
    config = throughput.ThroughputConfig(
        job=job, schedule=schedule, schedule_path=args.schedule,
        out=_out(args.out), policy=_policy(args, schedule.system_mtbf_s()),
        timeout_s=args.run_timeout)
    try:
        results = throughput.run(config, say)
    except (JobFailed, RuntimeError) as exc:
        print(f"recover bench throughput: {exc}", file=sys.stderr)
        return 1
    print(throughput.format_table(results))
    print(f"results: {config.out / 'results.json'}; plots: {', '.join(results['plots'])}")
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from recover.bench import elastic_sim, simulate

    calibration = None
    if args.calibrate is not None:
        try:
            calibration = json.loads(Path(args.calibrate).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UsageError(f"--calibrate {args.calibrate!r}: cannot read a results.json ({exc})"
                             ) from None
        if calibration.get("benchmark") != "throughput":
            raise UsageError(f"--calibrate {args.calibrate!r}: not a `bench throughput` results.json")
    out = _out(args.out)
    results = simulate.main(calibration, args.seed)
    results["capacity_comes_back"] = {"assumptions": elastic_sim.ASSUMED_ELASTIC,
                                      "projections": elastic_sim.projections(args.seed)}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(simulate.format_table(results))
    print(elastic_sim.format_table(results["capacity_comes_back"]["projections"]))
    print(f"results: {out / 'results.json'}")
    return 0


def main(args: argparse.Namespace) -> int:
    # Started in the background by a non-interactive shell, this process would ignore
    # SIGINT and pass that on to the jobs it launches; run_recover stops a launcher
    # with SIGINT (so that it stops its controller and agents), so restore the default.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.bench == "throughput":
        return _throughput(args)
    if args.bench == "simulate":
        return _simulate(args)
    return bench_more.main(args)
