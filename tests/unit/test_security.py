"""Credentials (common/security.py) and certificates (cli/certs.py): tokens, identities from
certificates, unusable settings named before anything starts."""

from __future__ import annotations

import datetime
import queue
from pathlib import Path

import pytest

from recover.cli.certs import init_ca, issue
from recover.cli.jobargs import UsageError
from recover.common.explain import exposure
from recover.common.security import (
    ALL_ROLES,
    ANONYMOUS,
    Authenticator,
    Role,
    Security,
    SecurityError,
    certificate_identity,
    from_values,
    match_token,
    read_tokens,
)


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("ca")
    init_ca(folder, "test CA", 30)
    issue(folder, "controller", [Role.CONTROLLER], ["127.0.0.1"], 30)
    issue(folder, "host0", [Role.AGENT], [], 30)
    issue(folder, "alice", [Role.READER, Role.OPERATOR], [], 30)
    return folder


def test_tokens_parse_with_roles_and_subjects_and_match_in_constant_time(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# tokens of the cluster\nsecret-a agent host0\n\nsecret-b reader,operator\n"
                    "secret-c   # every role\n")
    tokens = read_tokens(str(path))
    assert [(t.roles, t.subject) for t in tokens] == [
        (frozenset({Role.AGENT}), "host0"), (frozenset({Role.READER, Role.OPERATOR}), "token-4"),
        (ALL_ROLES, "token-5")]
    assert match_token("secret-b", tokens) is tokens[1]
    assert match_token("secret-", tokens) is None and match_token("", tokens) is None
    path.write_text("secret-a admin\n")
    with pytest.raises(SecurityError, match="unknown role in 'admin'"):
        read_tokens(str(path))


@pytest.mark.parametrize("settings, message", [
    (dict(cert="c.pem"), "needs its key"),
    (dict(key="k.pem"), "needs its key"),
    (dict(ca="missing.pem"), "--tls-ca 'missing.pem' is not a readable file"),
    (dict(token_file="empty"), "holds no token"),
    (dict(ca="garbage"), "is not a PEM certificate"),
])
def test_unusable_settings_are_named(tmp_path: Path, monkeypatch, settings, message) -> None:
    monkeypatch.chdir(tmp_path)
    Path("empty").write_text("# nothing\n")
    Path("garbage").write_text("not a certificate\n")
    with pytest.raises(SecurityError, match=message):
        Security(**settings).check("recover agent")


def test_an_expired_certificate_is_refused_before_anything_starts(ca: Path) -> None:
    past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=2)
    cert, key = issue(ca, "old", [Role.AGENT], [], 1, not_before=past,
                      not_after=past + datetime.timedelta(days=1))
    with pytest.raises(SecurityError, match="expired on"):
        Security(cert=str(cert), key=str(key), ca=str(ca / "ca.pem")).check("recover agent")


@pytest.mark.parametrize("key, message", [
    ("alice-key.pem", "is not the key of --tls-cert"),   # another holder's key
    ("host0.pem", "is not a PEM private key"),           # a certificate in the key's place
    (None, "is encrypted; it must be an unencrypted PEM key"),
])
def test_a_key_that_is_not_the_certificates_is_named(ca: Path, tmp_path: Path, key: str | None,
                                                    message: str) -> None:
    # gRPC took such a pair without a word, logged its own lines and then failed every call
    # as "no controller answers".
    if key is None:
        from cryptography.hazmat.primitives import serialization

        own = serialization.load_pem_private_key((ca / "host0-key.pem").read_bytes(), None)
        path = tmp_path / "locked-key.pem"
        path.write_bytes(own.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret")))
    else:
        path = ca / key
    with pytest.raises(SecurityError, match=message):
        Security(cert=str(ca / "host0.pem"), key=str(path), ca=str(ca / "ca.pem")).check("x")
    Security(cert=str(ca / "host0.pem"), key=str(ca / "host0-key.pem"),
             ca=str(ca / "ca.pem")).check("x")


def test_options_fall_back_to_the_environment() -> None:
    env = {"RECOVER_TLS_CA": "/etc/recover/ca.pem", "RECOVER_TOKEN_FILE": "/run/token"}
    security = from_values(ca=None, token_file="/mine", environ=env)
    assert security == Security(ca="/etc/recover/ca.pem", token_file="/mine")
    assert security.describe() == "TLS + bearer token" and security.enabled
    assert not from_values(environ={}).enabled


def test_a_certificate_names_its_holder_and_roles(ca: Path) -> None:
    assert certificate_identity((ca / "alice.pem").read_bytes()) == (
        "alice", frozenset({Role.READER, Role.OPERATOR}))
    assert certificate_identity((ca / "host0.pem").read_bytes()) == ("host0", {Role.AGENT})


def test_certs_never_overwrite_and_need_a_ca(ca: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="exists; not overwriting"):
        issue(ca, "host0", [Role.AGENT], [], 30)
    with pytest.raises(UsageError, match="no CA in"):
        issue(tmp_path, "x", [Role.AGENT], [], 30)
    assert (ca / "host0-key.pem").stat().st_mode & 0o077 == 0  # a private key stays private
    # A pair is written whole or not at all: with either half in the way, nothing new is
    # written (a fresh key beside the old certificate would pass for its pair).
    for kept in ("host0.pem", "host0-key.pem"):
        half = tmp_path / "half"
        half.mkdir()
        for name in ("ca.pem", "ca-key.pem", kept):
            (half / name).write_bytes((ca / name).read_bytes())
        with pytest.raises(UsageError, match="exists; not overwriting"):
            issue(half, "host0", [Role.AGENT], [], 30)
        assert sorted(p.name for p in half.iterdir()) == sorted(["ca.pem", "ca-key.pem", kept])
        for path in half.iterdir():
            path.unlink()
        half.rmdir()


def test_identify_by_certificate_token_or_both(ca: Path, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("tok-agent agent host0\ntok-reader reader grafana\n")
    alice = (ca / "alice.pem").read_bytes()
    with_cert = {"x509_pem_cert": [alice]}
    bearer = [("authorization", "Bearer tok-reader")]

    plain = Authenticator(Security())
    assert plain.identify({}, []) is ANONYMOUS

    mtls = Authenticator(Security(cert=str(ca / "controller.pem"),
                                  key=str(ca / "controller-key.pem"), ca=str(ca / "ca.pem")))
    identity = mtls.identify(with_cert, [])
    assert not isinstance(identity, str)
    assert (identity.subject, identity.roles, identity.proof) == (
        "alice", {Role.READER, Role.OPERATOR}, "certificate")
    assert "no client certificate" in str(mtls.identify({}, []))

    by_token = Authenticator(Security(token_file=str(tokens)))
    identity = by_token.identify({}, bearer)
    assert not isinstance(identity, str) and identity.subject == "grafana"
    assert "no bearer token" in str(by_token.identify({}, []))
    assert "not one this controller accepts" in str(
        by_token.identify({}, [("authorization", "Bearer tok-")]))

    both = Authenticator(Security(cert=str(ca / "controller.pem"),
                                  key=str(ca / "controller-key.pem"), ca=str(ca / "ca.pem"),
                                  token_file=str(tokens)))
    identity = both.identify(with_cert, bearer)  # each credential limits: reader only
    assert not isinstance(identity, str)
    assert (identity.subject, identity.roles, identity.proof) == (
        "alice", {Role.READER}, "certificate+token")


def test_a_token_file_others_can_read_is_warned_about_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    private, shared = tmp_path / "private", tmp_path / "shared"
    for path, mode in ((private, 0o600), (shared, 0o644)):
        path.write_text("secret-token reader alice\n")
        path.chmod(mode)
    with caplog.at_level("WARNING", logger="recover.security"):
        assert read_tokens(str(private)) and read_tokens(str(shared)) and read_tokens(str(shared))
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [f"token file {shared} can be read by others than its owner (mode 644): "
                        "chmod 600 it"]


@pytest.mark.parametrize(("security", "loopback", "phrase"), [
    (Security(), True, ""),
    (Security(), False, "without TLS or a token: anyone who reaches it can act as an agent"),
    (Security(token_file="t"), False, "with tokens but without TLS: tokens and the job's "
                                      "messages cross the network in the clear"),
    (Security(cert="c", key="k"), False, "with TLS but neither --tls-ca nor a token"),
    (Security(cert="c", key="k"), True, ""),
    (Security(cert="c", key="k", ca="a"), False, ""),
    (Security(cert="c", key="k", token_file="t"), False, ""),
])
def test_what_a_controller_leaves_open_is_one_warning(security: Security, loopback: bool,
                                                      phrase: str) -> None:
    warning = exposure(security, loopback)
    assert (phrase in warning) if phrase else warning == ""


@pytest.mark.parametrize("roles, hosts, serves", [
    ([Role.CONTROLLER], ["localhost"], True),
    ([Role.RELAY], ["localhost"], True),  # a relay serves its rack's agents
    ([Role.AGENT], [], False),
    ([Role.READER, Role.OPERATOR], [], False),
])
def test_only_a_serving_certificate_can_serve(tmp_path: Path, roles: list[Role],
                                               hosts: list[str], serves: bool) -> None:
    """An agent's or an operator's certificate has no server purpose: a client (an agent
    following a leader hint) refuses it at the handshake even when its name is the address
    dialled (here `localhost`, which the name check alone would accept), so it cannot pose
    as a controller. A real gRPC server on loopback, a real TLS handshake."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    init_ca(tmp_path, "test CA", 1)
    cert_path, key_path = issue(tmp_path, "localhost", roles, hosts, 1)
    server = grpc.server(ThreadPoolExecutor(1))
    port = server.add_secure_port("localhost:0", grpc.ssl_server_credentials(
        [(key_path.read_bytes(), cert_path.read_bytes())]))
    server.start()
    channel = grpc.secure_channel(f"localhost:{port}",
                                  grpc.ssl_channel_credentials((tmp_path / "ca.pem").read_bytes()))
    # The first state the connection settles in: READY (the handshake passed) or
    # TRANSIENT_FAILURE (the client refused the certificate), rather than a timeout.
    settled: queue.SimpleQueue[grpc.ChannelConnectivity] = queue.SimpleQueue()

    def watch(state: grpc.ChannelConnectivity) -> None:
        if state in (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE):
            settled.put(state)

    channel.subscribe(watch, try_to_connect=True)
    try:
        handshake = settled.get(timeout=30) is grpc.ChannelConnectivity.READY
    finally:
        channel.unsubscribe(watch)
        channel.close()
        server.stop(None)
    assert handshake is serves


@pytest.mark.parametrize(("security", "plain", "expected"), [
    (Security(), False, {}),  # plaintext controller: plain metrics
    (Security(cert="c.pem", key="k.pem"), False,
     {"certfile": "c.pem", "keyfile": "k.pem", "client_cafile": None,
      "client_auth_required": False}),  # TLS, tokens for clients: HTTPS without client certs
    (Security(cert="c.pem", key="k.pem", ca="ca.pem"), False,
     {"certfile": "c.pem", "keyfile": "k.pem", "client_cafile": "ca.pem",
      "client_auth_required": True}),  # mutual TLS: so are the metrics
    (Security(cert="c.pem", key="k.pem", ca="ca.pem"), True, {}),  # --metrics-plain
], ids=["plaintext", "tls", "mutual-tls", "metrics-plain"])
def test_the_metrics_endpoint_is_as_closed_as_the_controller_unless_told(
        security: Security, plain: bool, expected: dict) -> None:
    from recover.controller.server import metrics_tls

    assert metrics_tls(security, plain) == expected


def test_a_certificate_never_outlives_its_ca(tmp_path: Path, capsys) -> None:
    from cryptography import x509

    from recover.cli.main import main

    main(["certs", "init", str(tmp_path), "--days", "30"])
    main(["certs", "issue", str(tmp_path), "h", "--role", "agent", "--role", "agent"])
    out = capsys.readouterr().out
    ca_end = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes()).not_valid_after_utc
    end = x509.load_pem_x509_certificate((tmp_path / "h.pem").read_bytes()).not_valid_after_utc
    assert end == ca_end  # --days 365 asked for, the CA's 30 given
    assert "(roles agent; valid until" in out and "when the CA ends" in out
