"""Where the controller keeps what must outlive a controller process.

`Store` is the interface (shaped after etcd's key-value API so an etcd
implementation drops in); `MemoryStore` is the embedded one-machine default.
Values are serialized protobuf messages, never pickles.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Iterable


class StoreError(RuntimeError):
    """The store could not serve a request (unreachable, refused)."""


class Store(abc.ABC):
    """Async key-value store with prefix reads and compare-and-swap."""

    @abc.abstractmethod
    async def get(self, key: str) -> bytes | None:
        """The value at `key`, or None."""

    @abc.abstractmethod
    async def put(self, key: str, value: bytes) -> None:
        """Store `value` at `key` durably before returning."""

    @abc.abstractmethod
    async def put_many(self, items: Iterable[tuple[str, bytes]]) -> None:
        """Store several keys in one atomic write."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove `key` (no error when absent)."""

    @abc.abstractmethod
    async def get_prefix(self, prefix: str) -> list[tuple[str, bytes]]:
        """Every (key, value) whose key starts with `prefix`, sorted by key."""

    @abc.abstractmethod
    async def compare_and_put(self, key: str, expected: bytes | None, value: bytes) -> bool:
        """Put `value` only if the current value equals `expected` (None: absent)."""

    async def close(self) -> None:
        """Release connections."""


class MemoryStore(Store):
    """In-process store: the default when one machine runs the whole job.

    Durable only for the life of the controller process; use the etcd store
    to survive the controller's loss.
    """

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = asyncio.Lock()

    async def get(self, key: str) -> bytes | None:
        return self._data.get(key)

    async def put(self, key: str, value: bytes) -> None:
        self._data[key] = bytes(value)

    async def put_many(self, items: Iterable[tuple[str, bytes]]) -> None:
        self._data.update((k, bytes(v)) for k, v in items)

    async def delete(self, key: str) -> None:
        self._data.pop(key, None)

    async def get_prefix(self, prefix: str) -> list[tuple[str, bytes]]:
        return sorted((k, v) for k, v in self._data.items() if k.startswith(prefix))

    async def compare_and_put(self, key: str, expected: bytes | None, value: bytes) -> bool:
        async with self._lock:
            if self._data.get(key) != expected:
                return False
            self._data[key] = bytes(value)
            return True


def open_store(url: str) -> Store:
    """Build a store from a URL: `memory://` (default) or `etcd://HOST:PORT[,HOST:PORT...]`.

    Raises StoreError with a one-line reason for a malformed URL.
    """
    if url in ("", "memory", "memory://"):
        return MemoryStore()
    if url.startswith("etcd://"):
        from recover.controller.etcd_store import EtcdStore, parse_etcd_url

        try:
            return EtcdStore(parse_etcd_url(url))
        except ValueError as exc:
            raise StoreError(str(exc)) from None
    raise StoreError(f"unsupported store {url!r}: use memory:// or etcd://HOST:PORT[,HOST:PORT...]")
