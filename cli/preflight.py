"""Checks made before anything starts: a bad address, an unreachable store, an output folder
that is no folder. Each fails in one line naming the value, within a bounded time."""

from __future__ import annotations

import asyncio
import ipaddress
import socket

from recover.cli.jobargs import UsageError

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
