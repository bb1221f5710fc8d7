"""Which store a controller keeps its job in, from the URL an operator gives.

Apart from store.py so that the store's interface does not depend on its etcd
implementation (which depends on the interface).
"""

from __future__ import annotations

from recover.controller.store import MemoryStore, Store, StoreError


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
