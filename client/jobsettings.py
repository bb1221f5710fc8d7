"""Every setting of a job, defined once.

A setting has a flag (of `recover run`, `recover controller` and `recover bench throughput |
overhead`), a key in a TOML job file, a JobConfig field, a parser for its text, a default,
a help line and its checks. The argparse flags and the JobConfig built from them
(cli/jobargs.py), the job file's tables (cli/jobfile.py) and the flags that rebuild a
JobConfig (client/launch.py) are all derived from SETTINGS: a new setting is one entry here
plus its proto field. The worker command and the built-in GPT's own flags
(workloads/tinygpt/config.py) are not job settings: together they make the workload.

A check returns the one-line message for a bad value (the caller raises it as its own kind
of usage error); a check that names another setting runs after that one is parsed, since
every flag is parsed before any check runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from recover.client.testinputs import check_kills, check_slowdowns
from recover.common.progress import FIRST_MICROBATCH_GRACE_S
from recover.controller.policy import POLICIES, ProportionalPolicy
from recover.proto import pb
from recover.trainer.faults import format_fault_spec, parse_fault_spec
from recover.trainer.slowdown import format_slowdown_spec, parse_slowdown_spec

MAX_SEED = 2 ** 63 - 1
MAX_STEPS = 10 ** 12
MAX_REPLICAS = 1 << 16
MAX_MICROBATCHES = 1 << 24


class SettingError(ValueError):
    """A setting's value cannot work; the message is one line naming the flag."""


Check = Callable[[Any, argparse.Namespace], "str | None"]
Fields = dict[str, Any]
"""JobConfig field paths (`testing.compute_ms`) and their values."""


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


@dataclass(frozen=True)
class Setting:
    """One job setting: everything the flag, the job file and the JobConfig need of it."""

    flag: str
    """The long flag; its dest (and job-file key) is the name with underscores."""
    field: str
    """The JobConfig field it sets, as a dotted path."""
    help: str
    default: Any = None
    """None: not given (the JobConfig gets what `to_proto` makes of that)."""
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    short: str | None = None
    metavar: str | None = None
    action: Literal["store", "store_true", "toggle", "append"] = "store"
    """toggle: --flag / --no-flag; append: repeatable, a list (of strings in a job file)."""
    group: str = "job"
    """Its group in --help, and its table in a job file unless `section` says otherwise."""
    section: str | None = None
    """Its table in a job file, where that is not its --help group."""
    key: str | None = None
    """Its key in the job file (default: the dest)."""
    table: bool = False
    """In a job file, a TOML table, handed on as JSON text."""
    check: Check | None = None
    to_proto: Callable[[Any, argparse.Namespace], Fields] | None = None
    """The JobConfig fields of a given value (default: `field` = the value)."""
    to_flags: Callable[[pb.JobConfig], list[str]] | None = None
    """The flags that give back its fields of a JobConfig (default: from `field`)."""
    needs: str | None = None
    """The dest of a setting without which this one is left out of the JobConfig."""
    absent_is_default: bool = False
    """Unset (0, "") in a JobConfig written before the setting existed: means the default."""

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    @property
    def file_section(self) -> str:
        return self.section or self.group

    @property
    def file_key(self) -> str:
        return self.key or self.dest

    def fields(self, args: argparse.Namespace) -> Fields:
        value = getattr(args, self.dest)
        return self.to_proto(value, args) if self.to_proto else {self.field: value}

    def flags(self, job: pb.JobConfig) -> list[str]:
        if self.to_flags is not None:
            return self.to_flags(job)
        if self.needs is not None and not get_field(job, BY_DEST[self.needs].field):
            return []
        value = get_field(job, self.field)
        if self.action == "store_true":
            return [self.flag] if value else []
        if self.action == "toggle":
            return [self.flag if value else f"--no-{self.flag[2:]}"]
        if self.absent_is_default and not value:
            value = self.default
        if self.default is None and not value:
            return []  # never given: the flag left out means the same
        # `--flag=value`: a value that starts with a dash stays a value.
        return [f"{self.flag}={value!r}" if isinstance(value, float) else f"{self.flag}={value}"]


def get_field(job: pb.JobConfig, path: str) -> Any:
    value: Any = job
    for name in path.split("."):
        value = getattr(value, name)
    return value


def _check_checkpoint_dir(value: str | None, args: argparse.Namespace) -> str | None:
    if value is not None and not value.strip():
        return "--checkpoint-dir is empty"
    if value and os.path.exists(value) and not os.path.isdir(value):
        return f"--checkpoint-dir {value!r} is a file, not a folder"
    return None


def _positive(flag: str, unit: str = "number") -> Check:
    return lambda value, args: None if 0 < value < math.inf else (
        f"{flag} must be a positive {unit}, got {value}")


def _checks(*checks: Check) -> Check:
    """Several checks of one setting, in order: the first problem is the one reported."""
    return lambda value, args: next((p for c in checks if (p := c(value, args))), None)


MAX_RANKS_PER_REPLICA = 1024


def _check_workload_config(text: str | None, args: argparse.Namespace) -> str | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"--workload-config is not JSON: {exc}"
    return None if isinstance(value, dict) else "--workload-config must be a JSON object"


def _checkpoint_every_flags(job: pb.JobConfig) -> list[str]:
    if not job.checkpoint.dir:
        return []
    every = (str(job.checkpoint.every_steps) if job.checkpoint.every_steps
             else f"{job.checkpoint.every_s!r}s")
    return ["--checkpoint-every", every]


SETTINGS: tuple[Setting, ...] = (
    Setting("--replicas", "replicas", short="-R", type=positive_int, default=4,
            help="data-parallel replicas at start (default 4)",
            check=lambda v, a: None if v <= MAX_REPLICAS else (
                f"--replicas must be at most {MAX_REPLICAS}, got {v}")),
    Setting("--steps", "steps", short="-T", type=positive_int, default=50,
            help="optimizer steps to train (default 50)",
            check=lambda v, a: None if v <= MAX_STEPS else (
                f"--steps must be at most {MAX_STEPS}, got {v}")),
    Setting("--min-replicas", "min_replicas", type=positive_int, default=1, absent_is_default=True,
            help="after a worker failed during startup, the job may start with this many "
                 "replicas; the others join later (default 1)",
            check=lambda v, a: None if v <= a.replicas else (
                f"--min-replicas ({v}) cannot exceed --replicas ({a.replicas})")),
    Setting("--spares", "spares", type=int, default=0,
            help="hot spares beyond --replicas: they keep a live copy of the state and take a "
                 "lost replica's place at the next step (default 0)",
            check=lambda v, a: None if 0 <= v <= MAX_REPLICAS else (
                f"--spares must be between 0 and {MAX_REPLICAS}, got {v}")),
    Setting("--ranks-per-replica", "ranks_per_replica", type=positive_int, default=1,
            absent_is_default=True,
            help="worker processes per replica (default 1): a replica shards its model over "
                 "its ranks (FSDP2 on recover.trainer's Job.replica_mesh) and is lost as a "
                 "unit; an agent's slots hold whole replicas",
            check=lambda v, a: None if v <= MAX_RANKS_PER_REPLICA else (
                f"--ranks-per-replica must be at most {MAX_RANKS_PER_REPLICA}, got {v}")),
    Setting("--global-microbatches", "global_microbatches", short="-M", type=positive_int,
            default=16, help="microbatches summed by every step, whatever survives (default 16)",
            check=_checks(
                lambda v, a: None if v <= MAX_MICROBATCHES else (
                    f"--global-microbatches must be at most {MAX_MICROBATCHES}, got {v}"),
                lambda v, a: None if v >= a.replicas else (
                    f"--global-microbatches ({v}) must be at least --replicas ({a.replicas}): "
                    "every replica needs a microbatch"))),
    Setting("--seed", "seed", type=int, default=0,
            help="the job's seed: model init, sample order, dropout (default 0)",
            check=lambda v, a: None if -MAX_SEED - 1 <= v <= MAX_SEED else (
                f"--seed must fit in 64 bits (|seed| < 2**63), got {v}")),
    Setting("--reduce", "reduce", choices=("fast", "exact"), default="fast",
            help="gradient reduction: fast = float sum (default); exact = integer fixed point, "
                 "bitwise identical to the failure-free run"),
    Setting("--reduce-dtype", "reduce_dtype", choices=("grad", "float32"), default="grad",
            absent_is_default=True,
            help="fast reduction: in each gradient's own dtype (default) or in float32",
            check=lambda v, a: None if a.reduce != "exact" or v == "grad" else (
                "--reduce-dtype applies to --reduce fast (exact reduction is integer fixed "
                "point whatever the gradient dtype)")),
    Setting("--group-backend", "group_backend", choices=("gloo", "nccl"), default="gloo",
            absent_is_default=True,
            help="the cross-replica groups: gloo (default; GPU gradients staged through pinned "
                 "host memory) or nccl (GPU gradients reduced on the GPUs: every replica's "
                 "model on a GPU of its own)"),
    Setting("--overlap-reduce", "reduce_after_backward", action="toggle",
            help="fast mode: reduce a large gradient in pieces of 25 MB, each started as soon "
                 "as the step's last backward has produced it, as DDP does (default); "
                 "--no-overlap-reduce reduces all of it after that backward",
            to_proto=lambda v, a: {"reduce_after_backward": v is False},
            to_flags=lambda job: ["--no-overlap-reduce"] if job.reduce_after_backward else []),
    Setting("--check-determinism", "check_determinism", action="toggle",
            help="compute microbatch 0 twice before training and compare the gradients "
                 "bitwise, on every replica (default: on with --reduce exact; in fast mode "
                 "only its batch is loaded twice and compared); --no-check-determinism skips "
                 "both",
            to_proto=lambda v, a: {"check_determinism": a.reduce == "exact" if v is None else v,
                                   "skip_batch_check": v is False},
            to_flags=lambda job: ["--check-determinism"] if job.check_determinism else
            ["--no-check-determinism"] if job.skip_batch_check else []),
    Setting("--record-sample-ids", "record_sample_ids", action="store_true", default=False,
            help="keep every step's sample ids in the ledger and summary.json, not only their "
                 "digest"),
    Setting("--policy", "policy", choices=tuple(POLICIES), default=ProportionalPolicy.name,
            absent_is_default=True,
            help="who computes which microbatches: proportional = quotas by measured speed, "
                 "uniform while replicas are about as fast, and a lost replica's microbatches "
                 "recomputed by the survivors that finish them earliest (default); recover = "
                 "uniform quotas, lost microbatches to the least-loaded survivors; drop = the "
                 "step goes on without a lost replica's microbatches (ablation)"),
    Setting("--work-stealing", "work_stealing", action="store_true", default=False,
            help="inside a step, a replica that has finished its microbatches takes some that "
                 "a slower one has not started (with any --policy; see the README)"),
    Setting("--hang-timeout", "hang_timeout_s", type=float, default=2.0,
            help="watchdog: seconds without a liveness beat, and the least time one microbatch "
                 "may take, before a worker is killed as hung (default 2)",
            check=_positive("--hang-timeout")),
    Setting("--hang-factor", "hang_factor", type=float, default=10.0,
            help="watchdog: a microbatch may take this many times the worker's typical "
                 "microbatch time (default 10)",
            check=_positive("--hang-factor")),
    Setting("--first-microbatch-grace", "first_microbatch_grace_s", type=float,
            default=FIRST_MICROBATCH_GRACE_S, absent_is_default=True,
            help="watchdog: seconds a worker's first microbatch may take (warm-up, "
                 f"torch.compile, a lazy data load; default {FIRST_MICROBATCH_GRACE_S:g})",
            check=_positive("--first-microbatch-grace")),
    Setting("--group-timeout", "group_timeout_s", type=float, default=30.0,
            help="safety-net timeout of a generation's collectives, seconds",
            check=_positive("--group-timeout", "number of seconds")),
    Setting("--job-id", "job_id", help="name of the job (default: random)",
            to_proto=lambda v, a: {"job_id": v or f"job-{uuid.uuid4().hex[:8]}"}),
    Setting("--checkpoint-dir", "checkpoint.dir", metavar="DIR",
            help="write checkpoints for total loss here (shared by the hosts), in the "
                 "background at committed steps",
            check=_check_checkpoint_dir,
            to_proto=lambda v, a: {"checkpoint.dir": os.path.abspath(v)} if v else {}),
    Setting("--checkpoint-every", "checkpoint.every_steps", type=checkpoint_interval,
            metavar="N|Ns", needs="checkpoint_dir",
            help="every N committed steps, or every N seconds with an s (default 100)",
            check=lambda v, a: "--checkpoint-every goes with --checkpoint-dir (a resumed "
            "job: --checkpoint-dir DIR --checkpoint-every N sets its schedule; without both it "
            "keeps the checkpoint's)" if v is not None and a.checkpoint_dir is None else None,
            to_proto=lambda v, a: dict(zip(("checkpoint.every_steps", "checkpoint.every_s"),
                                           v or (100, 0.0), strict=True)),
            to_flags=_checkpoint_every_flags),
    Setting("--checkpoint-keep", "checkpoint.keep", type=positive_int, default=3, metavar="K",
            needs="checkpoint_dir", absent_is_default=True,
            help="complete checkpoints kept; older ones are deleted (default 3)",
            check=lambda v, a: "--checkpoint-keep goes with --checkpoint-dir (without it no "
            "checkpoint is written; a resumed job: --checkpoint-dir DIR --checkpoint-keep K sets "
            "it, without both it keeps the checkpoint's)" if v != 3 and a.checkpoint_dir is None
            else None),
    Setting("--workload-config", "workload.config_json", metavar="JSON", section="workload",
            key="config", table=True,
            help="a JSON object every worker receives as recover.trainer Job.config (a job "
                 "file's [workload.config])",
            check=_check_workload_config,
            to_proto=lambda v, a: {"workload.config_json": "" if v is None
                                   else json.dumps(json.loads(v), sort_keys=True)}),
    Setting("--kill", "testing.faults", action="append", default=(), metavar="SPEC",
            group="testing",
            help="inject a fault: step=S,replica=R,phase=P[,microbatch=K][,seconds=X]; crash "
                 "phases: forward, backward, reduce, commit, rebuild, recompute; hangs: stop, "
                 "spin, deadlock; slow (alive, seconds=X per microbatch)",
            check=check_kills,
            to_proto=lambda v, a: {"testing.faults": [parse_fault_spec(t) for t in v]},
            to_flags=lambda job: [f"--kill={format_fault_spec(f)}" for f in job.testing.faults]),
    Setting("--compute-ms", "testing.compute_ms", type=float, default=0.0, metavar="MS",
            group="testing",
            help="emulated accelerator time: each microbatch also sleeps MS ms after its real "
                 "forward/backward, so capacity belongs to each slot (default 0)",
            check=lambda v, a: None if 0 <= v < 3_600_000 else (
                f"--compute-ms must be a number of milliseconds >= 0, got {v}")),
    Setting("--slowdown", "testing.slowdowns", action="append", default=(), metavar="SPEC",
            group="testing",
            help="slow a replica: replica=R,factor=F[,from_step=S][,until_step=T]; in steps "
                 "[S, T) (default: all) each of replica id R's microbatches takes F times its "
                 "compute (real and --compute-ms), 1 <= F < 100; repeatable",
            check=check_slowdowns,
            to_proto=lambda v, a: {"testing.slowdowns": [parse_slowdown_spec(t) for t in v]},
            to_flags=lambda job: [f"--slowdown={format_slowdown_spec(s)}"
                                  for s in job.testing.slowdowns]),
    Setting("--overlap-piece-kb", "testing.overlap_piece_bytes", type=positive_int,
            metavar="KB", group="testing",
            help="with --overlap-reduce, pieces of KB KiB instead of 25 MB, so that a small "
                 "model's reduction has pieces too (tests, benchmarks)",
            to_proto=lambda v, a: {"testing.overlap_piece_bytes": (v or 0) * 1024},
            to_flags=lambda job: [f"--overlap-piece-kb={job.testing.overlap_piece_bytes // 1024}"]
            if job.testing.overlap_piece_bytes else []),
    Setting("--digest-inline", "testing.digest_inline", action="store_true", default=False,
            group="testing",
            help="hash each step's digest before the next step starts instead of on a thread "
                 "while it computes (benchmarks: bench/scripts/overlap_ab.py --variants)"),
)
BY_DEST = {s.dest: s for s in SETTINGS}


def job_fields(args: argparse.Namespace) -> Fields:
    """The JobConfig fields of parsed flags, checked first: SettingError with the first
    problem, in the order of SETTINGS."""
    for setting in SETTINGS:
        check = setting.check
        problem = check(getattr(args, setting.dest), args) if check else None
        if problem:
            raise SettingError(problem)
    found: Fields = {}
    for setting in SETTINGS:
        if setting.needs is None or getattr(args, setting.needs):
            fields = setting.fields(args)
            for path, value in fields.items():
                largest = _largest(path)
                if largest is not None and isinstance(value, int) and value > largest:
                    raise SettingError(f"{setting.flag} must be at most {largest}, got {value}")
            found.update(fields)
    return found


def _largest(path: str) -> int | None:
    """The largest value JobConfig's integer field at `path` holds (None: not an integer)."""
    descriptor = pb.JobConfig.DESCRIPTOR
    *parents, name = path.split(".")
    for parent in parents:
        descriptor = descriptor.fields_by_name[parent].message_type
    field = descriptor.fields_by_name[name]
    return {field.CPPTYPE_INT32: 2**31 - 1, field.CPPTYPE_INT64: 2**63 - 1,
            field.CPPTYPE_UINT32: 2**32 - 1, field.CPPTYPE_UINT64: 2**64 - 1}.get(field.cpp_type)


def nested(found: Fields) -> dict[str, Any]:
    """{"testing.compute_ms": 5} -> {"testing": {"compute_ms": 5}}: JobConfig(**...)'s form,
    where a sub-message is present exactly when one of its fields is named."""
    tree: dict[str, Any] = {}
    for path, value in found.items():
        *parents, name = path.split(".")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[name] = value
    return tree


def job_flags(job: pb.JobConfig) -> list[str]:
    """The flags that give back every setting of `job` (the worker command not included)."""
    return [part for setting in SETTINGS for part in setting.flags(job)]
