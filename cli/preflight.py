"""Checks made before anything starts: a bad address, an unreachable store, an output folder
that is no folder, a worker command that is no program, a checkpoint folder that cannot hold
its key. Each fails in one line naming the value, within a bounded time."""

from __future__ import annotations

import asyncio
import ipaddress
import shutil
import socket
from pathlib import Path

from recover.cli.jobargs import UsageError
from recover.common import ckptfile

STORE_TIMEOUT_S = 10.0
"""How long a store gets to answer before the command gives up on it."""


def check_host(host: str, flag: str = "--host") -> None:
    """`host` must be an IP address of this machine, or a name that resolves to one."""
    try:
        ipaddress.ip_address(host)
        literal = True
    except ValueError:
        literal = False
    if not literal:
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            raise UsageError(f"{flag} {host!r} is neither an IP address nor a host name that "
                             "resolves") from None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
    except OSError as exc:
        raise UsageError(f"{flag} {host!r} is not an address of this machine ({exc.strerror})"
                         ) from None


def check_store(url: str, prog: str, timeout_s: float = STORE_TIMEOUT_S) -> None:
    """The store must answer now: a typo in --store should not cost a minute of retries."""
    from recover.controller.store import StoreError
    from recover.controller.store_url import open_store

    try:
        store = open_store(url)
    except StoreError as exc:
        raise UsageError(f"{prog}: --store: {exc}") from None
    ping = getattr(store, "ping", None)
    if ping is None:
        return

    async def probe() -> None:
        try:
            await asyncio.wait_for(ping(), timeout_s)
        finally:
            await asyncio.wait_for(store.close(), 2.0)

    try:
        asyncio.run(probe())
    except (TimeoutError, StoreError, OSError) as exc:
        detail = f": {exc}" if str(exc) else ""
        raise UsageError(f"{prog}: --store {url}: no answer within {timeout_s:.0f}s{detail} (is "
                         "etcd running there?)") from None


def check_out(out: str) -> None:
    if not out.strip():
        raise UsageError("--out is empty: name a folder for summary.json and the logs")


def check_command(command: list[str]) -> None:
    """Catch the typos a local job would otherwise meet in every worker's log."""
    program = command[0]
    if program not in ("python", "python3") and shutil.which(program) is None:
        raise UsageError(f"recover run: the worker command {program!r} is not a program on PATH")
    if program in ("python", "python3") and len(command) > 1 and command[1].endswith(".py") \
            and not Path(command[1]).is_file():
        raise UsageError(f"recover run: no script {command[1]!r} (the worker command is run "
                         "from the current directory)")


def check_checkpoint_folder(folder: str, resumed: bool = False) -> None:
    """Make the folder and its key now (every host of a local job is this one), so that a
    folder that cannot hold them is one line before anything starts, not a failed write.
    A new job is refused a folder that holds checkpoints already: its files would replace
    some of theirs (same step, same name) and sit beside the rest, and `--resume` of the
    folder would then pick whichever is newest. A resumed job goes on in its own folder."""
    if not folder:
        return
    try:
        found = [] if resumed else ckptfile.listed(Path(folder))
    except OSError:
        found = []  # said below, as the folder's key cannot be made either
    if found:
        step, newest = found[0]
        raise UsageError(f"recover run: --checkpoint-dir {folder!r} holds {len(found)} "
                         f"checkpoint{'s' if len(found) > 1 else ''} already (newest "
                         f"{newest.name}, step {step}): a new job would overwrite and mix with "
                         f"them; resume that job with --resume {folder}, or give an empty folder")
    try:
        ckptfile.folder_key(Path(folder), create=True)
    except ckptfile.CheckpointError as exc:
        raise UsageError(f"recover run: --checkpoint-dir {folder!r}: {exc}") from None
    except OSError as exc:
        raise UsageError(f"recover run: --checkpoint-dir {folder!r}: "
                         f"{exc.strerror or exc}") from None
