"""The etcd implementation of `Store` (aetcd client, etcd v3 API).

One gRPC channel to every listed member (`ipv4:a:p1,b:p2,...`): when the
member in use dies, gRPC moves to another. Every operation is retried with
backoff for `retry_s`, which covers an etcd leader election (~2 s); after
that it fails with StoreError and a reason a user can act on. A watch has
no such deadline: it is re-created from the next revision for as long as
its consumer listens (etcd keeps the history, so nothing is skipped).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import TypeVar

import aetcd
import aetcd.exceptions

from recover.controller.store import Compare, KeyChange, Store, StoreError, Write

log = logging.getLogger("recover.controller")

T = TypeVar("T")

CANCEL_WATCH_S = 0.5
"""How long dropping a watch may take before we stop waiting for it."""

PERMANENT = (
    aetcd.exceptions.InvalidArgumentError,
    aetcd.exceptions.UnauthenticatedError,
    aetcd.exceptions.PreconditionFailedError,
)
"""Errors no retry can clear: raised, not retried."""

RETRYABLE = (
    aetcd.exceptions.ConnectionFailedError,
    aetcd.exceptions.ConnectionTimeoutError,
    aetcd.exceptions.InternalError,
    aetcd.exceptions.ClientError,
)


def parse_etcd_url(url: str) -> list[tuple[str, int]]:
    """`etcd://HOST:PORT[,HOST:PORT...]` -> [(host, port), ...]; ValueError with the reason."""
    if not url.startswith("etcd://"):
        raise ValueError(f"store URL {url!r} must start with etcd://")
    endpoints = []
    for part in url[len("etcd://"):].rstrip("/").split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"store URL {url!r}: {part!r} is not HOST:PORT")
        endpoints.append((host, int(port)))
    return endpoints


class EtcdStore(Store):
    def __init__(self, endpoints: list[tuple[str, int]], *, retry_s: float = 10.0,
                 op_timeout_s: float = 2.0) -> None:
        if not endpoints:
            raise ValueError("an etcd store needs at least one endpoint")
        self.endpoints = endpoints
        self._retry_s = retry_s
        # aetcd dials f"{host}:{port}": splitting a multi-address target at its
        # last colon makes it dial every member through one channel.
        target = "ipv4:" + ",".join(f"{h}:{p}" for h, p in endpoints)
        host, _, port = target.rpartition(":")
        self._client = aetcd.Client(host=host, port=int(port), timeout=op_timeout_s,
                                    options={"grpc.initial_reconnect_backoff_ms": 100,
                                             "grpc.max_reconnect_backoff_ms": 1000})
        self._closed = False

    @property
    def description(self) -> str:
        return "etcd://" + ",".join(f"{h}:{p}" for h, p in self.endpoints)

    async def _retry(self, what: str, operation: Callable[[], Awaitable[T]]) -> T:
        deadline = time.monotonic() + self._retry_s
        delay = 0.05
        while True:
            try:
                return await operation()
            except RETRYABLE as exc:
                if time.monotonic() >= deadline:
                    raise StoreError(f"etcd at {self.description} failed to {what} for "
                                     f"{self._retry_s:.0f}s: {type(exc).__name__}: {exc}") from None
                log.warning("etcd %s failed (%s); retrying", what, type(exc).__name__)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)

    async def get(self, key: str) -> bytes | None:
        return (await self._read(key)).value

    async def put(self, key: str, value: bytes) -> None:
        await self._retry("write", lambda: self._client.put(key.encode(), bytes(value)))

    async def put_many(self, items: Iterable[tuple[str, bytes]]) -> None:
        items = list(items)
        if not items:
            return
        txn = self._client.transactions
        ops = [txn.put(k.encode(), bytes(v)) for k, v in items]
        for start in range(0, len(ops), 100):  # etcd's --max-txn-ops is 128 by default
            chunk = ops[start:start + 100]
            await self._retry("write", lambda chunk=chunk: self._client.transaction(
                compare=[], success=chunk, failure=[]))

    async def delete(self, key: str) -> None:
        await self._retry("delete", lambda: self._client.delete(key.encode()))

    async def get_prefix(self, prefix: str) -> list[tuple[str, bytes]]:
        result = await self._retry("read", lambda: self._client.get_prefix(
            prefix.encode(), sort_order="ascend", sort_target="key"))
        return [(kv.key.decode(), bytes(kv.value)) for kv in result]

    async def compare_and_put(self, key: str, expected: bytes | None, value: bytes) -> bool:
        """Atomic CAS. Not retried blindly: a retry after an ambiguous timeout could
        report failure for a write that went through, so ambiguity surfaces as StoreError."""
        txn = self._client.transactions
        compare = ([txn.version(key.encode()) == 0] if expected is None
                   else [txn.value(key.encode()) == bytes(expected)])
        success = [txn.put(key.encode(), bytes(value))]
        try:
            succeeded, _ = await self._client.transaction(compare=compare, success=success,
                                                          failure=[])
        except RETRYABLE as exc:
            raise StoreError(f"etcd at {self.description}: compare-and-put of {key} "
                             f"failed: {type(exc).__name__}") from None
        return bool(succeeded)

    async def transaction(self, compares: Sequence[Compare], writes: Sequence[Write]) -> bool:
        txn = self._client.transactions
        checks = [txn.version(k.encode()) == 0 if v is None else txn.value(k.encode()) == bytes(v)
                  for k, v in compares]
        ops = [txn.put(w.key.encode(), bytes(w.value), lease=w.lease or None) for w in writes]

        async def run() -> bool:
            succeeded, _ = await self._client.transaction(compare=checks, success=ops, failure=[])
            return bool(succeeded)

        return await self._retry("write", run)

    async def _read(self, key: str) -> KeyChange:
        """The key's value with the store revision it was read at (even when absent)."""
        raw = key.encode()
        result = await self._retry("read", lambda: self._client.get_range(raw, raw + b"\0"))
        value = bytes(result.kvs[0].value) if len(result) else None
        return KeyChange(int(result.header.revision), value)

    async def watch(self, key: str) -> AsyncIterator[KeyChange]:
        """See `Store.watch`. Ends when the store is closed; raises StoreError when a read
        it needs (the first one, or one after a compaction) fails for `retry_s`, or when
        etcd refuses the watch for good (bad argument, authentication)."""
        first = await self._read(key)
        yield first
        async with contextlib.aclosing(self._changes_after(key, first.revision)) as changes:
            async for change in changes:
                yield change

    async def _changes_after(self, key: str, revision: int) -> AsyncIterator[KeyChange]:
        delay = 0.05
        while not self._closed:  # aetcd would reconnect a closed client to serve us
            try:
                # From the revision after the last one seen: a watch re-created after
                # a break (member lost, etcd restarted) replays what happened meanwhile.
                watch = await self._client.watch(key.encode(), start_revision=revision + 1)
                try:
                    async for event in watch:
                        revision, delay = int(event.kv.mod_revision), 0.05
                        yield KeyChange(revision, None if event.kind == "DELETE"
                                        else bytes(event.kv.value))
                finally:
                    await self._cancel_watch(watch)
            except aetcd.exceptions.RevisionCompactedError:
                log.warning("watch of %s fell behind a compaction; reading it afresh", key)
                current = await self._read(key)
                revision = current.revision
                yield current
            except PERMANENT as exc:
                raise StoreError(f"etcd at {self.description} refused a watch of {key}: "
                                 f"{type(exc).__name__}: {exc}") from None
            except RETRYABLE as exc:
                log.warning("watch of %s broke (%s); re-creating it from revision %d", key,
                            type(exc).__name__, revision + 1)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    @staticmethod
    async def _cancel_watch(watch: aetcd.rtypes.Watch) -> None:
        """Tell etcd to drop a watch, bounded: aetcd's cancel takes its watcher's lock and
        queues a request on the shared watch stream, and a consumer that stopped
        watching must not wait on either for long. If it does not get through, the
        server-side watch lingers only until the stream or the client closes."""
        try:
            await asyncio.wait_for(watch.cancel(), CANCEL_WATCH_S)
        except (TimeoutError, aetcd.exceptions.ClientError):
            pass

    async def grant_lease(self, ttl_s: int) -> int:
        lease = await self._retry("grant a lease", lambda: self._client.lease(ttl_s))
        return int(lease.id)

    async def refresh_lease(self, lease: int) -> bool:
        """One keep-alive round trip, not retried: the caller's lease clock decides."""
        try:
            reply = await self._client.refresh_lease(lease)
        except RETRYABLE as exc:
            raise StoreError(f"etcd at {self.description}: lease keep-alive failed: "
                             f"{type(exc).__name__}") from None
        return reply is not None and reply.TTL > 0

    async def revoke_lease(self, lease: int) -> None:
        try:
            await self._client.revoke_lease(lease)
        except aetcd.exceptions.ClientError:
            pass  # already gone, or etcd away: then it expires on its own within its TTL

    async def ping(self) -> None:
        """Fail with StoreError unless etcd answers within the retry window."""
        await self._retry("answer", self._client.status)

    async def close(self) -> None:
        self._closed = True
        await self._client.close()
