"""etcd with TLS, client certificates and users (etcds://): a real etcd started with
--client-cert-auth; the store works with the right credentials, refuses clearly without
them, and a whole job runs on it (issue 14)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aetcd.rpc
import grpc
import pytest

from recover.controller.etcd_store import EtcdAccess, EtcdStore, parse_etcd_access
from recover.controller.store import StoreError
from recover.controller.store_url import open_store
from tests.etcd_cluster import EtcdCluster, TLSFiles, make_tls
from tests.integration.conftest import run_recover

pytestmark = [pytest.mark.timeout(180)]


@pytest.fixture()
def secured(tmp_path: Path):  # type: ignore[no-untyped-def]
    tls = make_tls(tmp_path / "tls")
    cluster = EtcdCluster(tmp_path / "etcd", tls=tls).start()
    try:
        yield cluster, tls
    finally:
        cluster.stop()


def access(tls: TLSFiles, **extra: str) -> EtcdAccess:
    return EtcdAccess(tls=True, ca=str(tls.ca), cert=str(tls.client_cert),
                      key=str(tls.client_key), **extra)


async def enable_auth(cluster: EtcdCluster, tls: TLSFiles, password: str) -> None:
    """etcd's own API (what `etcdctl user add root; etcdctl auth enable` does)."""
    credentials = access(tls).channel_credentials()
    async with grpc.aio.secure_channel(f"127.0.0.1:{cluster.client_ports[0]}", credentials) as ch:
        auth = aetcd.rpc.AuthStub(ch)
        await auth.UserAdd(aetcd.rpc.AuthUserAddRequest(name="root", password=password))
        await auth.UserGrantRole(aetcd.rpc.AuthUserGrantRoleRequest(user="root", role="root"))
        await auth.AuthEnable(aetcd.rpc.AuthEnableRequest())


def test_the_store_speaks_tls_with_client_certificates_and_users(secured, tmp_path) -> None:
    cluster, tls = secured
    endpoints = cluster.endpoints()

    async def scenario() -> None:
        store = EtcdStore(endpoints, access=access(tls), retry_s=5)
        await store.put("/k", b"over tls")
        assert await store.get("/k") == b"over tls"
        changes = store.watch("/k")
        assert (await anext(changes)).value == b"over tls"
        await store.put("/k", b"changed")
        assert (await anext(changes)).value == b"changed"
        await changes.aclose()
        await store.close()

        for wrong, expected in (
                (EtcdAccess(), "failed to read"),  # plaintext to a TLS member
                (EtcdAccess(tls=True, ca=str(tls.ca)), "failed to read")):  # no client cert
            refused = EtcdStore(endpoints, access=wrong, retry_s=1.0, op_timeout_s=0.5)
            with pytest.raises(StoreError, match=expected):
                await refused.get("/k")
            await refused.close()

        await enable_auth(cluster, tls, "s3cret")
        password = tmp_path / "password"
        password.write_text("s3cret\n")
        store = EtcdStore(endpoints, access=access(tls, user="root",
                                                   password_file=str(password)), retry_s=5)
        await store.put("/k", b"as root")
        assert await store.get("/k") == b"as root"
        await store.close()
        password.write_text("guess\n")
        wrong = EtcdStore(endpoints, access=access(tls, user="root", password_file=str(password)),
                          retry_s=2)
        with pytest.raises(StoreError, match="authentication failed|refused"):
            await wrong.get("/k")
        await wrong.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("query, message", [
    ("?cert=/x", "cert= and key= go together"),
    (",127.0.0.2:2379", "members on several hosts over TLS need server_name=NAME"),
    ("?ca=/nonexistent", "ca=/nonexistent is not a readable file"),
    ("?colour=blue", "'colour=blue' is not one of ca=..."),
    ("?password_file=/etc/hostname", "password_file= needs user="),
])
def test_bad_store_urls_are_named(query: str, message: str) -> None:
    with pytest.raises(StoreError, match=message):
        open_store("etcds://127.0.0.1:2379" + query)
    assert not parse_etcd_access("etcd://127.0.0.1:2379").tls


@pytest.mark.slow
def test_three_members_over_tls_one_lost(tmp_path: Path) -> None:
    """One channel reaches every member: their certificates are checked against the one name
    they share (server_name=), and losing the member in use moves to another."""
    cluster = EtcdCluster(tmp_path / "etcd", members=3, tls=make_tls(tmp_path / "tls")).start()
    try:
        async def scenario() -> None:
            store = open_store(cluster.url)
            for member in range(3):
                await store.put("/k", f"with {member} down".encode())
                cluster.kill_member(member)
                assert await store.get("/k") == f"with {member} down".encode()
                cluster.start_member(member)
            await store.close()

        asyncio.run(scenario())
    finally:
        cluster.stop()


def test_a_job_runs_on_a_secured_etcd(secured, tmp_path: Path) -> None:
    cluster, _ = secured
    result = run_recover(tmp_path / "run", "--store", cluster.url, "--replicas", "2",
                         "--steps", "5", "--quiet", "--tls", timeout=150)
    assert result.returncode == 0, result.stderr
    assert result.summary["steps_committed"] == 5
