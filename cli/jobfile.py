"""Job files: the settings of `recover run` / `recover controller` in TOML.

    [job]                       # the core: what ReCoVer needs
    replicas = 4
    steps = 200
    global_microbatches = 32
    reduce = "exact"

    [workload]                  # what the workers run
    command = ["python", "train.py", "--hidden", "256"]
    config = { lr = 3e-4 }      # every worker gets it as Job.config

    [testing]                   # fault injection, emulated accelerator time
    kill = ["step=10,replica=1,phase=backward"]

    [security]                  # recover controller: tls_cert, tls_key, tls_ca, token_file
    tls_cert = "/etc/recover/controller.pem"   # recover run: tls = true

Keys are the long flags' names with underscores. Without a `command`, the
`[workload]` table takes the built-in reference GPT's settings
(`microbatch_size`, `lr`, ...). The file's values become the flags'
defaults, so a flag given on the command line wins. Each value is checked
as its flag would be; an unknown key or a wrong type is a one-line error.
"""

from __future__ import annotations

import argparse
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recover.cli.jobargs import UsageError
from recover.client.jobsettings import BY_DEST, SETTINGS, Setting
from recover.workloads.tinygpt import config as tinygpt

MAX_JOB_FILE_BYTES = 1 << 20
"""Settings, not data: anything larger is a mistake (a wrong path)."""


def _keys(section: str) -> tuple[str, ...]:
    return tuple(s.file_key for s in SETTINGS if s.file_section == section)


# The job settings' keys come from their one definition (client/jobsettings.py); the
# worker command, the built-in GPT's settings and the credentials are not job settings.
SECTIONS = {
    "job": _keys("job"),
    "workload": ("command", *_keys("workload"), *tinygpt.FLAGS),
    "testing": _keys("testing"),
    "security": ("tls", "tls_cert", "tls_key", "tls_ca", "token_file"),
}
DESTS = {"command": "file_command", **{s.file_key: s.dest for s in SETTINGS if s.file_key != s.dest}}
"""Keys whose flag stores under another name."""


def find_job_file(argv: list[str]) -> str | None:
    """The value of `--job FILE` / `--job=FILE` among the options before `--` (a job is one
    file: two are refused rather than one silently ignored)."""
    found = []
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == "--job" and i + 1 < len(argv):
            found.append(argv[i + 1])
        elif arg.startswith("--job="):
            found.append(arg.split("=", 1)[1])
    if len(found) > 1:
        raise UsageError(f"--job given {len(found)} times ({', '.join(map(repr, found))}): a job "
                         "is one file (flags after it change its settings)")
    return found[0] if found else None


def load(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Read `path` and check every value against `parser`'s flags: {dest: value}."""
    try:
        file = Path(path)
        if file.exists() and not file.is_file():  # a folder, a device, a pipe: never ends
            raise UsageError(f"--job {path!r}: not a regular file")
        if file.exists() and file.stat().st_size > MAX_JOB_FILE_BYTES:
            raise UsageError(f"--job {path!r}: {file.stat().st_size} bytes; a job file is at "
                             f"most {MAX_JOB_FILE_BYTES // 1024} KiB")
        data = tomllib.loads(file.read_text())
    except FileNotFoundError:
        raise UsageError(f"--job {path!r}: no such file") from None
    except OSError as exc:
        raise UsageError(f"--job {path!r}: cannot read it: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"--job {path!r}: not valid TOML: {exc}") from None
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise UsageError(f"--job {path!r}: unknown section(s) {unknown}; expected "
                         f"{', '.join(f'[{s}]' for s in SECTIONS)}")
    actions = {a.dest: a for a in parser._actions}  # noqa: SLF001 - argparse has no public map
    values: dict[str, Any] = {}
    for section, keys in SECTIONS.items():
        table = data.get(section, {})
        if not isinstance(table, dict):
            raise UsageError(f"--job {path!r}: [{section}] must be a table")
        extra = sorted(set(table) - set(keys))
        if extra:
            raise UsageError(f"--job {path!r}: unknown key(s) {extra} in [{section}]")
        for key, value in table.items():
            where = f"--job {path!r}: [{section}] {key}"
            dest = DESTS.get(key, key)
            if section == "security" and dest not in actions:
                raise UsageError(f"{where}: `{parser.prog}` has no such option")
            values[dest] = _checked(where, key, value, actions.get(dest), BY_DEST.get(dest))
    if values.get("file_command") and any(k in values for k in tinygpt.FLAGS):
        raise UsageError(f"--job {path!r}: [workload] has a command and built-in GPT settings; "
                         "pass your script's settings in its command or its config table")
    return values


def _checked(where: str, key: str, value: Any, action: argparse.Action | None,
             setting: Setting | None) -> Any:
    if key == "command" or (setting is not None and setting.action == "append"):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise UsageError(f"{where} must be a list of strings")
        if key == "command" and not value:
            raise UsageError(f"{where} is empty")
        return value
    if setting is not None and setting.table:
        if not isinstance(value, dict):
            raise UsageError(f"{where} must be a table")
        try:
            return json.dumps(value, sort_keys=True)
        except TypeError as exc:  # TOML dates and times have no JSON form
            raise UsageError(f"{where}: {exc} (use strings for dates and times)") from None
    assert action is not None, key
    if isinstance(action, argparse._StoreTrueAction | argparse.BooleanOptionalAction):  # noqa: SLF001
        if not isinstance(value, bool):
            raise UsageError(f"{where} must be true or false")
        return value
    if isinstance(value, bool | dict | list):
        raise UsageError(f"{where} must be a single value, got {type(value).__name__}")
    if action.type is not None:
        try:
            value = action.type(str(value))
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise UsageError(f"{where}: {exc}") from None
    elif not isinstance(value, str):
        raise UsageError(f"{where} must be a string")
    if action.choices is not None and value not in action.choices:
        raise UsageError(f"{where} must be one of {', '.join(map(str, action.choices))}")
    return value


@dataclass(frozen=True)
class Applied:
    """A job file made a parser's defaults: which flags stand for which of its keys."""

    path: str
    keys: dict[str, tuple[str, str, Any]] = field(default_factory=dict)
    """Long flag -> (its key in the file, "[job] replicas"; its dest; the file's value)."""

    def in_file_terms(self, message: str, args: argparse.Namespace | None) -> str:
        """`message` (a setting's check, naming flags) naming the file's keys instead of the
        flags whose value is the file's (`args`: as parsed; a flag given on the command line
        too, in any spelling, keeps its name), so a mistake in the file points at its line."""
        named = message
        for flag, (key, dest, value) in self.keys.items():
            if args is None or getattr(args, dest, value) == value:
                named = re.sub(re.escape(flag) + r"(?![\w-])", key, named)
        return named if named == message else f"{named} (in --job {self.path!r})"


def apply(parser: argparse.ArgumentParser, argv: list[str]) -> Applied | None:
    """Make a `--job FILE` in `argv` the defaults of `parser` (a subcommand's parser)."""
    path = find_job_file(argv)
    if path is None:
        return None
    values = load(path, parser)
    parser.set_defaults(**values)
    return Applied(path, {max(a.option_strings, key=len): (_file_key(a.dest), a.dest,
                                                           values[a.dest])
                          for a in parser._actions  # noqa: SLF001 - no public map
                          if a.dest in values and a.option_strings})


def _file_key(dest: str) -> str:
    key = next((k for k, d in DESTS.items() if d == dest), dest)
    section = next(s for s, keys in SECTIONS.items() if key in keys)
    return f"[{section}] {key}"
