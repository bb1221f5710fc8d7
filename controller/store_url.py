"""Which store a controller keeps its job in, from the URL an operator gives.

Apart from store.py so that the store's interface does not depend on its etcd
implementation (which depends on the interface).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from recover.controller.store import MemoryStore, Store, StoreError


@dataclass(frozen=True)
class StoreExposure:
    """Whether a controller may keep its job in a store, and what to warn about."""
    allowed: bool
    reason: str
    """Why it is refused, or the warning to log (empty: nothing worth saying)."""


def store_exposure(url: str, *, insecure_store: bool,
                   is_loopback: Callable[[str], bool]) -> StoreExposure:
    """A plaintext etcd decides who leads and so where agents go and what they run: whoever
    reaches it can write the leader key. Refused off this machine unless the operator says
    `--insecure-store` (a network nobody else reaches); a warning on loopback."""
    if not url.startswith("etcd://"):
        return StoreExposure(True, "")  # the memory store, or etcds:// (TLS)
    from recover.controller.etcd_store import parse_etcd_url

    try:
        hosts = sorted({host for host, _ in parse_etcd_url(url)})
    except ValueError:
        return StoreExposure(True, "")  # open_store says what is wrong with it
    remote = [h for h in hosts if not is_loopback(h)]
    if not remote:
        return StoreExposure(True, "the store is plaintext etcd: anyone on this machine can "
                                   "write the job's keys, the leader's included")
    if insecure_store:
        return StoreExposure(True, f"the store is plaintext etcd on {', '.join(remote)} "
                                   "(--insecure-store): whoever reaches it decides who leads "
                                   "the job")
    return StoreExposure(False, f"--store {url}: plaintext etcd on {', '.join(remote)} would let "
                                "anyone who reaches it choose the job's leader, and so what "
                                "every agent runs; use etcds:// (TLS, README \"Securing a "
                                "cluster\") or say --insecure-store on a network nobody else "
                                "reaches")


def open_store(url: str) -> Store:
    """Build a store from a URL: `memory://` (default), `etcd://HOST:PORT[,HOST:PORT...]`, or
    `etcds://...` with TLS and credentials (etcd_store.parse_etcd_access).

    Raises StoreError with a one-line reason for a malformed URL.
    """
    if url in ("", "memory", "memory://"):
        return MemoryStore()
    if url.startswith(("etcd://", "etcds://")):
        # Imported here: a memory-store controller (the local default) never loads aetcd.
        from recover.controller.etcd_store import EtcdStore, parse_etcd_access, parse_etcd_url

        try:
            return EtcdStore(parse_etcd_url(url), access=parse_etcd_access(url))
        except ValueError as exc:
            raise StoreError(str(exc)) from None
    raise StoreError(f"unsupported store {url!r}: use memory://, etcd://HOST:PORT[,HOST:PORT...] "
                     "or etcds://HOST:PORT[,...]?ca=FILE&cert=FILE&key=FILE (TLS)")
