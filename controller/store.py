"""Where the controller keeps what must outlive a controller process.

`Store` is the interface (shaped after etcd's key-value API so an etcd
implementation drops in); `MemoryStore` is the embedded one-machine default.
Values are serialized protobuf messages, never pickles.
"""

from __future__ import annotations

import abc
import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import NamedTuple


class StoreError(RuntimeError):
    """The store could not serve a request (unreachable, refused)."""


class Write(NamedTuple):
    """One put of a transaction."""

    key: str
    value: bytes
    lease: int = 0
    """Attach the key to this lease (0: none); the key goes when the lease does."""


Compare = tuple[str, bytes | None]
"""(key, value the key must hold) for a transaction; None: the key must be absent."""


class KeyChange(NamedTuple):
    """One observation of a watched key."""

    revision: int
    """Store revision of the change (or of the read, for the first observation)."""
    value: bytes | None
    """The key's value after the change; None: absent (deleted, or its lease ended)."""


class Store(abc.ABC):
    """Async key-value store with prefix reads, transactions and leases.

    Leases and transactions are what leader election and fenced writes need
    (controller/leader.py): a leader key lives as long as its lease, and every
    write of a leader is a transaction that compares the leader key first.
    """

    @abc.abstractmethod
    async def get(self, key: str) -> bytes | None:
        """The value at `key`, or None."""

    @abc.abstractmethod
    async def get_leased(self, key: str) -> tuple[bytes, int] | None:
        """The value at `key` and the lease it is attached to (0: none), or None."""

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

    @abc.abstractmethod
    async def transaction(self, compares: Sequence[Compare], writes: Sequence[Write]) -> bool:
        """Apply every write atomically if every compare holds; False (nothing written) if not.

        Implementations may retry across transient failures, so writes must be
        idempotent and a caller must expect a retry to find its own earlier
        success (a compare that no longer holds).
        """

    @abc.abstractmethod
    async def grant_lease(self, ttl_s: int) -> int:
        """A new lease of `ttl_s` seconds; returns its id (never 0)."""

    @abc.abstractmethod
    async def refresh_lease(self, lease: int) -> bool:
        """Extend the lease to its full TTL; False if it already expired or was revoked."""

    @abc.abstractmethod
    async def revoke_lease(self, lease: int) -> None:
        """End the lease now, deleting its keys (no error when already gone)."""

    @abc.abstractmethod
    def watch(self, key: str) -> AsyncIterator[KeyChange]:
        """The key's value now, then its value after every change, in revision order.

        Iterate it with `async for`; it goes on until the consumer stops or the
        store is closed. A store whose connection breaks re-creates the watch from
        the revision after the last one seen, so no change is skipped; one that
        cannot (history compacted) reports the key's current value instead. It
        raises StoreError only when the store stays unreachable for a read it
        needs or refuses the watch for good. Consumers that cannot afford a stuck
        watch (a partitioned etcd member sends nothing) re-read on a timer.
        """

    async def close(self) -> None:
        """Release connections."""


class MemoryStore(Store):
    """In-process store: the default when one machine runs the whole job.

    Durable only for the life of the controller process; use the etcd store
    to survive the controller's loss.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = asyncio.Lock()
        self._clock = clock
        self._lease_ids = itertools.count(1)
        self._leases: dict[int, tuple[float, int]] = {}
        """lease id -> (expiry on `clock`, TTL in seconds)."""
        self._leased_keys: dict[int, set[str]] = {}
        self._revision = 0
        self._watchers: dict[str, list[asyncio.Queue[KeyChange]]] = {}

    def _set(self, key: str, value: bytes | None, lease: int = 0) -> None:
        """Every mutation goes through here, so watchers see each one. As in etcd, a put
        attaches the key to `lease` and detaches it from any other (0: none)."""
        for keys in self._leased_keys.values():
            keys.discard(key)
        if lease and value is not None:
            self._leased_keys.setdefault(lease, set()).add(key)
        if value is None:
            if self._data.pop(key, None) is None:
                return  # deleting an absent key changes nothing
        else:
            self._data[key] = bytes(value)
        self._revision += 1
        for queue in self._watchers.get(key, ()):
            queue.put_nowait(KeyChange(self._revision, value))

    def _expire(self) -> None:
        now = self._clock()
        for lease in [lid for lid, (expiry, _) in self._leases.items() if expiry <= now]:
            self._drop_lease(lease)

    def _drop_lease(self, lease: int) -> None:
        self._leases.pop(lease, None)
        for key in sorted(self._leased_keys.pop(lease, set())):
            self._set(key, None)

    def _until_next_expiry(self) -> float | None:
        if not self._leases:
            return None
        return max(0.0, min(expiry for expiry, _ in self._leases.values()) - self._clock())

    async def watch(self, key: str) -> AsyncIterator[KeyChange]:
        queue: asyncio.Queue[KeyChange] = asyncio.Queue()
        self._watchers.setdefault(key, []).append(queue)
        try:
            self._expire()
            yield KeyChange(self._revision, self._data.get(key))
            while True:
                # Leases end lazily here (on access): wake for the next expiry so a
                # watcher sees a leased key vanish although nobody reads the store.
                try:
                    change = await asyncio.wait_for(queue.get(), self._until_next_expiry())
                except TimeoutError:
                    self._expire()
                    continue
                yield change
        finally:
            self._watchers[key].remove(queue)

    async def get(self, key: str) -> bytes | None:
        self._expire()
        return self._data.get(key)

    async def get_leased(self, key: str) -> tuple[bytes, int] | None:
        self._expire()
        value = self._data.get(key)
        if value is None:
            return None
        return value, next((lease for lease, keys in self._leased_keys.items() if key in keys), 0)

    async def put(self, key: str, value: bytes) -> None:
        self._set(key, value)

    async def put_many(self, items: Iterable[tuple[str, bytes]]) -> None:
        for key, value in items:
            self._set(key, value)

    async def delete(self, key: str) -> None:
        self._set(key, None)

    async def get_prefix(self, prefix: str) -> list[tuple[str, bytes]]:
        self._expire()
        return sorted((k, v) for k, v in self._data.items() if k.startswith(prefix))

    async def compare_and_put(self, key: str, expected: bytes | None, value: bytes) -> bool:
        async with self._lock:
            if self._data.get(key) != expected:
                return False
            self._set(key, value)
            return True

    async def transaction(self, compares: Sequence[Compare], writes: Sequence[Write]) -> bool:
        self._expire()
        if any(self._data.get(key) != expected for key, expected in compares):
            return False
        if any(w.lease and w.lease not in self._leases for w in writes):
            return False  # etcd refuses a put on an unknown lease; so do we
        for w in writes:
            self._set(w.key, w.value, w.lease)
        return True

    async def grant_lease(self, ttl_s: int) -> int:
        lease = next(self._lease_ids)
        self._leases[lease] = (self._clock() + ttl_s, ttl_s)
        return lease

    async def refresh_lease(self, lease: int) -> bool:
        self._expire()
        if lease not in self._leases:
            return False
        ttl = self._leases[lease][1]
        self._leases[lease] = (self._clock() + ttl, ttl)
        return True

    async def revoke_lease(self, lease: int) -> None:
        self._drop_lease(lease)
