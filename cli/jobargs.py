"""Job flags shared by `recover run` and `recover controller`, and their validation."""

from __future__ import annotations

import argparse
import math
import uuid

from recover.proto import pb
from recover.trainer.faults import FaultSpecError, format_fault_spec, parse_fault_spec


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


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    job = parser.add_argument_group("job")
    job.add_argument("--replicas", "-R", type=positive_int, default=4,
                     help="data-parallel replicas at start (default 4)")
    job.add_argument("--steps", "-T", type=positive_int, default=50,
                     help="optimizer steps to train (default 50)")
    job.add_argument("--global-microbatches", "-M", type=positive_int, default=16,
                     help="microbatches summed by every step, whatever survives (default 16)")
    job.add_argument("--microbatch-size", "-B", type=positive_int, default=8,
                     help="sequences per microbatch (default 8)")
    job.add_argument("--seed", type=int, default=0, help="seed of init, data and dropout (default 0)")
    job.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    job.add_argument("--reduce", choices=["fast", "exact"], default="fast",
                     help="gradient reduction: fast = float32 sum (default); exact = integer fixed "
                          "point, bitwise identical to the failure-free run")
    job.add_argument("--policy", choices=["recover", "drop"], default="recover",
                     help="what happens to a lost replica's microbatches: recover = survivors "
                          "compute them (default); drop = the step goes on without them (ablation)")
    job.add_argument("--hang-timeout", type=float, default=2.0,
                     help="watchdog: seconds without a liveness beat, and the least time one "
                          "microbatch may take, before a worker is killed as hung (default 2)")
    job.add_argument("--hang-factor", type=float, default=10.0,
                     help="watchdog: a microbatch may take this many times the worker's typical "
                          "microbatch time (default 10)")
    job.add_argument("--kill", action="append", default=[], metavar="SPEC",
                     help="inject a fault: step=S,replica=R,phase=P[,microbatch=K][,seconds=X]; "
                          "crash phases: forward, backward, reduce, commit, rebuild, recompute; "
                          "hangs: stop, spin, deadlock; slow (alive, seconds=X per microbatch)")
    job.add_argument("--compute-ms", type=float, default=0.0, metavar="MS",
                     help="emulated accelerator time: each microbatch also sleeps MS ms after its "
                          "real forward/backward, so capacity belongs to each slot (default 0)")
    job.add_argument("--job-id", default=None, help="name of the job (default: random)")
    model = parser.add_argument_group("model (reference GPT)")
    model.add_argument("--n-layer", type=positive_int, default=2)
    model.add_argument("--n-embd", type=positive_int, default=64)
    model.add_argument("--n-head", type=positive_int, default=4)
    model.add_argument("--seq-len", type=positive_int, default=32)
    model.add_argument("--vocab-size", type=positive_int, default=64)
    model.add_argument("--group-timeout", type=float, default=30.0,
                       help="safety-net timeout of a generation's collectives, seconds")


def job_from_args(args: argparse.Namespace) -> pb.JobConfig:
    """Validate the job flags and build the JobConfig; raises UsageError with the reason."""
    if args.global_microbatches < args.replicas:
        raise UsageError(
            f"--global-microbatches ({args.global_microbatches}) must be at least --replicas "
            f"({args.replicas}): every replica needs a microbatch")
    if args.n_embd % args.n_head:
        raise UsageError(f"--n-embd ({args.n_embd}) must be a multiple of --n-head ({args.n_head})")
    if not 0 < args.lr < math.inf:
        raise UsageError(f"--lr must be a positive number, got {args.lr}")
    if not 0 < args.group_timeout < math.inf:
        raise UsageError(f"--group-timeout must be a positive number of seconds, "
                         f"got {args.group_timeout}")
    for flag, value in (("--hang-timeout", args.hang_timeout), ("--hang-factor", args.hang_factor)):
        if not 0 < value < math.inf:
            raise UsageError(f"{flag} must be a positive number, got {value}")
    if not 0 <= args.compute_ms < 3_600_000:
        raise UsageError(f"--compute-ms must be a number of milliseconds >= 0, got {args.compute_ms}")
    faults = []
    for text in args.kill:
        try:
            spec = parse_fault_spec(text)
        except FaultSpecError as exc:
            raise UsageError(str(exc)) from None
        if spec.step >= args.steps:
            raise UsageError(f"--kill {text!r}: step {spec.step} is beyond the last step "
                             f"({args.steps - 1})")
        if spec.replica >= args.replicas:
            raise UsageError(f"--kill {text!r}: replica {spec.replica} does not exist "
                             f"(replicas are 0..{args.replicas - 1})")
        faults.append(spec)
    return pb.JobConfig(
        job_id=args.job_id or f"job-{uuid.uuid4().hex[:8]}",
        replicas=args.replicas, steps=args.steps,
        global_microbatches=args.global_microbatches, microbatch_size=args.microbatch_size,
        seed=args.seed, reduce=args.reduce, learning_rate=args.lr,
        model=pb.ModelConfig(vocab_size=args.vocab_size, seq_len=args.seq_len,
                             n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                             dropout=0.1),
        faults=faults, group_timeout_s=args.group_timeout, corpus_seed=1234,
        policy=args.policy, hang_timeout_s=args.hang_timeout, hang_factor=args.hang_factor,
        compute_ms=args.compute_ms)


def job_to_args(job: pb.JobConfig) -> list[str]:
    """The flags that rebuild `job` (how `recover run` hands it to its controller)."""
    args = [
        "--replicas", str(job.replicas), "--steps", str(job.steps),
        "--global-microbatches", str(job.global_microbatches),
        "--microbatch-size", str(job.microbatch_size), "--seed", str(job.seed),
        "--lr", repr(job.learning_rate), "--reduce", job.reduce, f"--job-id={job.job_id}",
        "--n-layer", str(job.model.n_layer), "--n-embd", str(job.model.n_embd),
        "--n-head", str(job.model.n_head), "--seq-len", str(job.model.seq_len),
        "--vocab-size", str(job.model.vocab_size), "--group-timeout", repr(job.group_timeout_s),
        "--policy", job.policy or "recover", "--hang-timeout", repr(job.hang_timeout_s),
        "--hang-factor", repr(job.hang_factor), "--compute-ms", repr(job.compute_ms),
    ]
    for fault in job.faults:
        args += ["--kill", format_fault_spec(fault)]
    return args


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
