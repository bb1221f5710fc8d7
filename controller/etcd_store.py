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
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import aetcd
import aetcd.exceptions
import aetcd.rpc
import aetcd.watcher
import grpc

from recover.controller.store import Compare, KeyChange, Store, StoreError, Write

log = logging.getLogger("recover.controller")

T = TypeVar("T")

CANCEL_WATCH_S = 0.5
"""How long dropping a watch may take before we stop waiting for it."""

PERMANENT = (
    aetcd.exceptions.InvalidArgumentError,
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
    """`etcd[s]://HOST:PORT[,HOST:PORT...][?...]` -> [(host, port), ...]; ValueError with the
    reason."""
    scheme, sep, rest = url.partition("://")
    if scheme not in ("etcd", "etcds") or not sep:
        raise ValueError(f"store URL {url!r} must start with etcd:// or etcds://")
    endpoints = []
    for part in rest.split("?", 1)[0].rstrip("/").split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"store URL {url!r}: {part!r} is not HOST:PORT")
        endpoints.append((host, int(port)))
    return endpoints


@dataclass(frozen=True)
class EtcdAccess:
    """TLS and credentials for etcd, from an `etcds://` URL's query
    (`?ca=FILE&cert=FILE&key=FILE&server_name=NAME&user=NAME&password_file=FILE`)."""

    tls: bool = False
    """etcds://: the members serve TLS (verified against `ca`, or the system's CAs)."""
    ca: str = ""
    """PEM CA certificate the members' certificates are signed by."""
    cert: str = ""
    """PEM client certificate (etcd --client-cert-auth; with etcd auth on, its CN is the user)."""
    key: str = ""
    """PEM key of `cert`."""
    server_name: str = ""
    """The name the members' certificates are checked against. One channel reaches every
    member, so with members on several hosts each certificate must carry one shared name
    (`recover certs issue --host NAME`); default: the members' host when they share one."""
    user: str = ""
    """etcd user (etcd auth), with its password in `password_file`."""
    password_file: str = ""

    def channel_credentials(self) -> grpc.ChannelCredentials:
        def read(path: str) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))

    def password(self) -> str | None:
        if not self.user:
            return None
        return Path(self.password_file).read_text().strip() if self.password_file else ""


ACCESS_KEYS = ("ca", "cert", "key", "server_name", "user", "password_file")


def parse_etcd_access(url: str) -> EtcdAccess:
    """The TLS and credentials an etcd URL asks for; ValueError naming what is wrong."""
    scheme, _, rest = url.partition("://")
    _, _, query = rest.partition("?")
    values: dict[str, str] = {}
    for item in filter(None, query.split("&")):
        name, eq, value = item.partition("=")
        if name not in ACCESS_KEYS or not eq or not value:
            raise ValueError(f"store URL {url!r}: {item!r} is not one of "
                             f"{', '.join(k + '=...' for k in ACCESS_KEYS)}")
        values[name] = value
    access = EtcdAccess(tls=scheme == "etcds", **values)
    if (access.ca or access.cert or access.server_name) and not access.tls:
        raise ValueError(f"store URL {url!r}: certificates go with etcds:// (TLS)")
    hosts = {host for host, _ in parse_etcd_url(url)}
    if access.tls and len(hosts) > 1 and not access.server_name:
        raise ValueError(f"store URL {url!r}: members on several hosts over TLS need "
                         "server_name=NAME, a name every member's certificate carries "
                         "(recover certs issue --host NAME)")
    if bool(access.cert) != bool(access.key):
        raise ValueError(f"store URL {url!r}: cert= and key= go together")
    if access.password_file and not access.user:
        raise ValueError(f"store URL {url!r}: password_file= needs user=")
    for name in ("ca", "cert", "key", "password_file"):
        path = getattr(access, name)
        if path and not Path(path).is_file():
            raise ValueError(f"store URL {url!r}: {name}={path} is not a readable file")
    return access


class _Client(aetcd.Client):
    """aetcd's client, over TLS when asked (aetcd itself dials plaintext only)."""

    def __init__(self, access: EtcdAccess, **kwargs: object) -> None:
        super().__init__(username=access.user or None, password=access.password(),
                         **kwargs)  # type: ignore[arg-type]
        self._access = access

    async def connect(self) -> None:
        if not self._access.tls or self._connected.is_set() or self._is_connecting:
            await super().connect()
            return
        # aetcd's connect with a secure channel; the rest as it builds it.
        self._is_connecting = True
        try:
            self.channel = grpc.aio.secure_channel(f"{self._host}:{self._port}",
                                                   self._access.channel_credentials(),
                                                   options=list(self._options.items()))
            if self._username is not None:
                self.auth_stub = aetcd.rpc.AuthStub(self.channel)
                reply = await self.auth_stub.Authenticate(aetcd.rpc.AuthenticateRequest(
                    name=self._username, password=self._password), timeout=self._timeout)
                self.metadata = (("token", reply.token),)
            self.kvstub = aetcd.rpc.KVStub(self.channel)
            self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
            self.leasestub = aetcd.rpc.LeaseStub(self.channel)
            self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd.watcher.Watcher(aetcd.rpc.WatchStub(self.channel),
                                                  timeout=self._timeout, metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False


class EtcdStore(Store):
    def __init__(self, endpoints: list[tuple[str, int]], *, retry_s: float = 10.0,
                 op_timeout_s: float = 2.0, access: EtcdAccess = EtcdAccess()) -> None:
        if not endpoints:
            raise ValueError("an etcd store needs at least one endpoint")
        self.endpoints = endpoints
        self._retry_s = retry_s
        self._access = access
        # aetcd dials f"{host}:{port}": splitting a multi-address target at its
        # last colon makes it dial every member through one channel.
        target = "ipv4:" + ",".join(f"{h}:{p}" for h, p in endpoints)
        host, _, port = target.rpartition(":")
        options: dict[str, object] = {"grpc.initial_reconnect_backoff_ms": 100,
                                      "grpc.max_reconnect_backoff_ms": 1000}
        if access.tls:
            # The multi-address target is no name a certificate could carry.
            options["grpc.ssl_target_name_override"] = access.server_name or endpoints[0][0]
        self._client = _Client(access, host=host, port=int(port), timeout=op_timeout_s,
                               options=options)
        self._closed = False

    @property
    def description(self) -> str:
        return ("etcds://" if self._access.tls else "etcd://") + ",".join(
            f"{h}:{p}" for h, p in self.endpoints)

    async def _retry(self, what: str, operation: Callable[[], Awaitable[T]]) -> T:
        deadline = time.monotonic() + self._retry_s
        delay = 0.05
        reauthenticated = False
        while True:
            try:
                return await operation()
            except aetcd.exceptions.UnauthenticatedError as exc:
                # etcd's auth tokens expire (--auth-token-ttl): authenticate again, once.
                if not self._access.user or reauthenticated:
                    raise StoreError(f"etcd at {self.description} refused to {what}: "
                                     f"{exc}") from None
                await self._client.close()
                reauthenticated = True
            except RETRYABLE as exc:
                if time.monotonic() >= deadline:
                    raise StoreError(f"etcd at {self.description} failed to {what} for "
                                     f"{self._retry_s:.0f}s: {type(exc).__name__}: {exc}") from None
                log.warning("etcd %s failed (%s); retrying", what, type(exc).__name__)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)

    async def get(self, key: str) -> bytes | None:
        return (await self._read(key)).value

    async def get_leased(self, key: str) -> tuple[bytes, int] | None:
        raw = key.encode()
        result = await self._retry("read", lambda: self._client.get_range(raw, raw + b"\0"))
        if not len(result):
            return None
        kv = result.kvs[0]
        return bytes(kv.value), int(kv.lease)

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
        refused = False
        while not self._closed:  # aetcd would reconnect a closed client to serve us
            try:
                # From the revision after the last one seen: a watch re-created after
                # a break (member lost, etcd restarted) replays what happened meanwhile.
                watch = await self._client.watch(key.encode(), start_revision=revision + 1)
                try:
                    async for event in watch:
                        revision, delay, refused = int(event.kv.mod_revision), 0.05, False
                        yield KeyChange(revision, None if event.kind == "DELETE"
                                        else bytes(event.kv.value))
                finally:
                    if not self._closed:  # a closed client's watches ended with its stream
                        await self._cancel_watch(watch)
            except aetcd.exceptions.RevisionCompactedError:
                log.warning("watch of %s fell behind a compaction; reading it afresh", key)
                current = await self._read(key)
                revision = current.revision
                yield current
            except aetcd.exceptions.UnauthenticatedError as exc:
                if not self._access.user or refused:  # a token that expired gets one renewal
                    raise StoreError(f"etcd at {self.description} refused a watch of {key}: "
                                     f"{exc}") from None
                refused = True
                await self._client.close()
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
        server-side watch lingers only until the stream or the client closes. A cancel that
        races the store's close finds aetcd's watcher gone (AttributeError on None, seen in a
        clean-clone run): the watch ended with the client."""
        try:
            await asyncio.wait_for(watch.cancel(), CANCEL_WATCH_S)
        except (TimeoutError, AttributeError, aetcd.exceptions.ClientError):
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
