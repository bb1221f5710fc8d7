"""Job flags shared by `recover run`, `recover controller` and `recover bench`, and their checks.

A job has three kinds of settings, kept apart in `pb.JobConfig`:
* the core (replicas, steps, M, seed, reduction, policy, timeouts): what ReCoVer needs;
* the workload: the worker command after `--` (any script using `recover.trainer`),
  or the built-in reference GPT and its own flags when no command is given, plus an
  opaque `config` table every worker receives (from a job file);
* testing-only settings: injected faults and emulated accelerator time.

Each setting is defined once, in recover.client.jobsettings; the flags here are made from it.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from google.protobuf.message import DecodeError

# Kept importable from here: job_from_args's inverse, and a flag type other commands use.
from recover.client.jobsettings import SETTINGS, SettingError, job_fields, nested
from recover.client.jobsettings import positive_int as positive_int
from recover.client.launch import JOB_PROTO_FLAG, taken_over
from recover.client.launch import job_to_args as job_to_args
from recover.proto import pb
from recover.workloads.tinygpt import config as tinygpt


class UsageError(Exception):
    """Bad user input: printed as one line, exit code 2."""


class SettingUsageError(UsageError):
    """A job setting's value cannot work (client/jobsettings.py's checks): the message names
    the flags, which a job file's keys may stand for (jobfile.Applied)."""


class Parser(argparse.ArgumentParser):
    """argparse that reports a mistake in one line instead of a usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message} (see `{self.prog} --help`)")


def add_job_arguments(parser: argparse.ArgumentParser, *, command: bool = True) -> None:
    groups = {"job": parser.add_argument_group("job")}
    groups["job"].add_argument("--job", metavar="FILE", default=None,
                               help="read settings from a TOML job file ([job], [workload], "
                                    "[testing]); flags given on the command line win")
    # How a parent process (`recover run`, a benchmark) hands over a job it has built and
    # checked, instead of spelling it out as flags; not for people, so not in --help.
    groups["job"].add_argument(JOB_PROTO_FLAG, default=None, help=argparse.SUPPRESS)
    for setting in SETTINGS:
        if setting.group not in groups:
            groups[setting.group] = parser.add_argument_group(setting.group)
        names = [setting.flag, *([setting.short] if setting.short else [])]
        options: dict[str, object] = {"default": setting.default, "help": setting.help}
        if setting.action == "store_true":
            options["action"] = "store_true"
        elif setting.action == "toggle":
            options["action"] = argparse.BooleanOptionalAction
        else:
            options.update(type=setting.type, choices=setting.choices, metavar=setting.metavar)
            if setting.action == "append":  # a list of its own per parser: append adds to it
                options.update(action="append", default=list(setting.default))
        groups[setting.group].add_argument(*names, **options)  # type: ignore[arg-type]
    builtin = parser.add_argument_group(
        "built-in workload (the reference GPT; used when no command follows --)")
    tinygpt.add_arguments(builtin, defaults=False)
    parser.set_defaults(file_command=None)
    if command:
        parser.add_argument("worker_command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                            help="the worker command, e.g. -- python train.py --lr 1e-3 (a leading "
                                 "`python` is ReCoVer's own interpreter); default: the reference GPT")


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


def job_from_args(args: argparse.Namespace) -> pb.JobConfig:
    """Validate the job flags and build the JobConfig; raises UsageError with the reason."""
    if args.job_proto is not None:
        try:
            return taken_over(args.job_proto)
        except (OSError, DecodeError) as exc:
            raise UsageError(f"{JOB_PROTO_FLAG} {args.job_proto!r}: not a readable JobConfig "
                             f"({exc})") from None
    try:
        fields = job_fields(args)
    except SettingError as exc:
        raise SettingUsageError(str(exc)) from None
    fields["workload.command"] = worker_command(args)
    return pb.JobConfig(**nested(fields))


def restart_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1000, got {value}")
    return value


def bounded_count(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number in [low, high], or one line saying what it must be."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {value}")
        return value
    return parse


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


def parse_addresses(text: str, flag: str = "--controller") -> list[str]:
    """HOST:PORT[,HOST:PORT...] -> the list; UsageError naming the bad part."""
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise UsageError(f"{flag} {text!r} has an empty address")
    return [parse_address(part, flag) for part in parts]
