"""Job flags shared by `recover run`, `recover controller` and `recover bench`, and their checks.

A job has three kinds of settings, kept apart in `pb.JobConfig`:
* the core (replicas, steps, M, seed, reduction, policy, timeouts): what ReCoVer needs;
* the workload: the worker command after `--` (any script using `recover.trainer`),
  or the built-in reference GPT and its own flags when no command is given, plus an
  opaque `config` table every worker receives (from a job file);
* testing-only settings: injected faults and emulated accelerator time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import uuid

from recover.proto import pb
from recover.trainer.faults import (
    ANY_REPLICA_PHASES,
    FaultSpecError,
    format_fault_spec,
    parse_fault_spec,
)
from recover.workloads.tinygpt import config as tinygpt

MAX_SEED = 2 ** 63 - 1
MAX_STEPS = 10 ** 12
MAX_REPLICAS = 1 << 16
MAX_MICROBATCHES = 1 << 24


class UsageError(Exception):
    """Bad user input: printed as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse that reports a mistake in one line instead of a usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message} (see `{self.prog} --help`)")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def checkpoint_interval(text: str) -> tuple[int, float]:
    """"25" -> every 25 steps; "90s" -> every 90 seconds."""
    try:
        if text.endswith("s"):
            seconds = float(text[:-1])
            if 0 < seconds < math.inf:
                return 0, seconds
        elif int(text) > 0:
            return int(text), 0.0
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected a number of steps (25) or seconds (90s), "
                                     f"got {text!r}")


def add_job_arguments(parser: argparse.ArgumentParser, *, command: bool = True) -> None:
    job = parser.add_argument_group("job")
    job.add_argument("--job", metavar="FILE", default=None,
                     help="read settings from a TOML job file ([job], [workload], [testing]); "
                          "flags given on the command line win")
    job.add_argument("--replicas", "-R", type=positive_int, default=4,
                     help="data-parallel replicas at start (default 4)")
    job.add_argument("--steps", "-T", type=positive_int, default=50,
                     help="optimizer steps to train (default 50)")
    job.add_argument("--min-replicas", type=positive_int, default=1,
                     help="after a worker failed during startup, the job may start with this "
                          "many replicas; the others join later (default 1)")
    job.add_argument("--spares", type=int, default=0,
                     help="hot spares beyond --replicas: they keep a live copy of the state and "
                          "take a lost replica's place at the next step (default 0)")
    job.add_argument("--global-microbatches", "-M", type=positive_int, default=16,
                     help="microbatches summed by every step, whatever survives (default 16)")
    job.add_argument("--seed", type=int, default=0,
                     help="the job's seed: model init, sample order, dropout (default 0)")
    job.add_argument("--reduce", choices=["fast", "exact"], default="fast",
                     help="gradient reduction: fast = float sum (default); exact = integer fixed "
                          "point, bitwise identical to the failure-free run")
    job.add_argument("--reduce-dtype", choices=["grad", "float32"], default="grad",
                     help="fast reduction: in each gradient's own dtype (default) or in float32")
    job.add_argument("--check-determinism", action=argparse.BooleanOptionalAction, default=None,
                     help="compute microbatch 0 twice before training and compare the gradients "
                          "bitwise, on every replica (default: on with --reduce exact)")
    job.add_argument("--record-sample-ids", action="store_true", default=False,
                     help="keep every step's sample ids in the ledger and summary.json, not only "
                          "their digest")
    job.add_argument("--policy", choices=["recover", "drop"], default="recover",
                     help="what happens to a lost replica's microbatches: recover = survivors "
                          "compute them (default); drop = the step goes on without them (ablation)")
    job.add_argument("--hang-timeout", type=float, default=2.0,
                     help="watchdog: seconds without a liveness beat, and the least time one "
                          "microbatch may take, before a worker is killed as hung (default 2)")
    job.add_argument("--hang-factor", type=float, default=10.0,
                     help="watchdog: a microbatch may take this many times the worker's typical "
                          "microbatch time (default 10)")
    job.add_argument("--group-timeout", type=float, default=30.0,
                     help="safety-net timeout of a generation's collectives, seconds")
    job.add_argument("--job-id", default=None, help="name of the job (default: random)")
    job.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                     help="write checkpoints for total loss here (shared by the hosts), in the "
                          "background at committed steps")
    job.add_argument("--checkpoint-every", type=checkpoint_interval, default=None, metavar="N|Ns",
                     help="every N committed steps, or every N seconds with an s (default 100)")
    job.add_argument("--checkpoint-keep", type=positive_int, default=3, metavar="K",
                     help="complete checkpoints kept; older ones are deleted (default 3)")
    job.add_argument("--workload-config", default=None, metavar="JSON",
                     help="a JSON object every worker receives as recover.trainer Job.config "
                          "(a job file's [workload.config])")
    testing = parser.add_argument_group("testing")
    testing.add_argument("--kill", action="append", default=[], metavar="SPEC",
                         help="inject a fault: step=S,replica=R,phase=P[,microbatch=K][,seconds=X]; "
                              "crash phases: forward, backward, reduce, commit, rebuild, recompute; "
                              "hangs: stop, spin, deadlock; slow (alive, seconds=X per microbatch)")
    testing.add_argument("--compute-ms", type=float, default=0.0, metavar="MS",
                         help="emulated accelerator time: each microbatch also sleeps MS ms after "
                              "its real forward/backward, so capacity belongs to each slot (default 0)")
    builtin = parser.add_argument_group(
        "built-in workload (the reference GPT; used when no command follows --)")
    tinygpt.add_arguments(builtin, defaults=False)
    parser.set_defaults(file_command=None)
    if command:
        parser.add_argument("worker_command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                            help="the worker command, e.g. -- python train.py --lr 1e-3 (a leading "
                                 "`python` is ReCoVer's own interpreter); default: the reference GPT")


def _check_core(args: argparse.Namespace) -> None:
    if args.replicas > MAX_REPLICAS:
        raise UsageError(f"--replicas must be at most {MAX_REPLICAS}, got {args.replicas}")
    if args.steps > MAX_STEPS:
        raise UsageError(f"--steps must be at most {MAX_STEPS}, got {args.steps}")
    if args.global_microbatches > MAX_MICROBATCHES:
        raise UsageError(f"--global-microbatches must be at most {MAX_MICROBATCHES}, got "
                         f"{args.global_microbatches}")
    if not 0 <= args.spares <= MAX_REPLICAS:
        raise UsageError(f"--spares must be between 0 and {MAX_REPLICAS}, got {args.spares}")
    if args.min_replicas > args.replicas:
        raise UsageError(f"--min-replicas ({args.min_replicas}) cannot exceed --replicas "
                         f"({args.replicas})")
    if args.global_microbatches < args.replicas:
        raise UsageError(
            f"--global-microbatches ({args.global_microbatches}) must be at least --replicas "
            f"({args.replicas}): every replica needs a microbatch")
    if not -MAX_SEED - 1 <= args.seed <= MAX_SEED:
        raise UsageError(f"--seed must fit in 64 bits (|seed| < 2**63), got {args.seed}")
    if not 0 < args.group_timeout < math.inf:
        raise UsageError(f"--group-timeout must be a positive number of seconds, "
                         f"got {args.group_timeout}")
    for flag, value in (("--hang-timeout", args.hang_timeout), ("--hang-factor", args.hang_factor)):
        if not 0 < value < math.inf:
            raise UsageError(f"{flag} must be a positive number, got {value}")
    if not 0 <= args.compute_ms < 3_600_000:
        raise UsageError(f"--compute-ms must be a number of milliseconds >= 0, got {args.compute_ms}")
    if args.reduce == "exact" and args.reduce_dtype != "grad":
        raise UsageError("--reduce-dtype applies to --reduce fast (exact reduction is integer "
                         "fixed point whatever the gradient dtype)")


def worker_command(args: argparse.Namespace) -> list[str]:
    """The command after `--`, the job file's, or the built-in GPT's with its flags."""
    given = list(getattr(args, "worker_command", None) or [])
    if given[:1] == ["--"]:
        given = given[1:]
    elif given:
        raise UsageError(f"unexpected argument {given[0]!r}: the worker command goes after `--`")
    command = given or list(args.file_command or [])
    builtin_flags = tinygpt.given(args)
    if command:
        if builtin_flags:
            raise UsageError(f"{', '.join(builtin_flags)} configure the built-in GPT; with a "
                             "command of your own, pass your script's flags after --")
        return command
    try:
        return tinygpt.command(tinygpt.from_args(args))
    except tinygpt.ConfigError as exc:
        raise UsageError(str(exc)) from None


def _workload_config(text: str | None) -> str:
    if text is None:
        return ""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--workload-config is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise UsageError("--workload-config must be a JSON object")
    return json.dumps(value, sort_keys=True)


def job_from_args(args: argparse.Namespace) -> pb.JobConfig:
    """Validate the job flags and build the JobConfig; raises UsageError with the reason."""
    _check_core(args)
    faults = []
    for text in args.kill:
        try:
            spec = parse_fault_spec(text)
        except FaultSpecError as exc:
            raise UsageError(str(exc)) from None
        if spec.step >= args.steps:
            raise UsageError(f"--kill {text!r}: step {spec.step} is beyond the last step "
                             f"({args.steps - 1})")
        if spec.replica >= args.replicas and spec.phase not in ANY_REPLICA_PHASES:
            raise UsageError(f"--kill {text!r}: replica {spec.replica} does not exist "
                             f"(replicas are 0..{args.replicas - 1})")
        faults.append(spec)
    check = args.reduce == "exact" if args.check_determinism is None else args.check_determinism
    every_steps, every_s = args.checkpoint_every or (100, 0.0)
    if args.checkpoint_dir is not None and not args.checkpoint_dir.strip():
        raise UsageError("--checkpoint-dir is empty")
    if args.checkpoint_every is not None and args.checkpoint_dir is None:
        raise UsageError("--checkpoint-every goes with --checkpoint-dir")
    checkpoint = pb.CheckpointConfig(
        dir=os.path.abspath(args.checkpoint_dir), every_steps=every_steps, every_s=every_s,
        keep=args.checkpoint_keep) if args.checkpoint_dir else None
    return pb.JobConfig(
        job_id=args.job_id or f"job-{uuid.uuid4().hex[:8]}",
        replicas=args.replicas, steps=args.steps, global_microbatches=args.global_microbatches,
        min_replicas=args.min_replicas, spares=args.spares,
        seed=args.seed, reduce=args.reduce, reduce_dtype=args.reduce_dtype,
        check_determinism=check, record_sample_ids=args.record_sample_ids,
        group_timeout_s=args.group_timeout, policy=args.policy,
        hang_timeout_s=args.hang_timeout, hang_factor=args.hang_factor,
        workload=pb.WorkloadSpec(command=worker_command(args),
                                 config_json=_workload_config(args.workload_config)),
        testing=pb.TestingConfig(faults=faults, compute_ms=args.compute_ms),
        checkpoint=checkpoint)


def job_to_args(job: pb.JobConfig) -> list[str]:
    """The flags that rebuild `job` (how `recover run` hands it to its controller). They
    end with `-- COMMAND`: a caller's own flags go before them."""
    args = [
        "--replicas", str(job.replicas), "--steps", str(job.steps),
        "--min-replicas", str(job.min_replicas or 1), "--spares", str(job.spares),
        "--global-microbatches", str(job.global_microbatches), "--seed", str(job.seed),
        "--reduce", job.reduce, "--reduce-dtype", job.reduce_dtype or "grad",
        "--check-determinism" if job.check_determinism else "--no-check-determinism",
        f"--job-id={job.job_id}", "--group-timeout", repr(job.group_timeout_s),
        "--policy", job.policy or "recover", "--hang-timeout", repr(job.hang_timeout_s),
        "--hang-factor", repr(job.hang_factor), "--compute-ms", repr(job.testing.compute_ms),
    ]
    if job.record_sample_ids:
        args.append("--record-sample-ids")
    if job.checkpoint.dir:
        every = (str(job.checkpoint.every_steps) if job.checkpoint.every_steps
                 else f"{job.checkpoint.every_s!r}s")
        args += ["--checkpoint-dir", job.checkpoint.dir, "--checkpoint-every", every,
                 "--checkpoint-keep", str(job.checkpoint.keep or 3)]
    if job.workload.config_json:
        args.append(f"--workload-config={job.workload.config_json}")
    for fault in job.testing.faults:
        args += ["--kill", format_fault_spec(fault)]
    return [*args, "--", *job.workload.command]


def restart_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1000, got {value}")
    return value


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def parse_address(text: str, flag: str = "--controller") -> str:
    """Check HOST:PORT and return it unchanged."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"{flag} {text!r} is not HOST:PORT")
    return text
