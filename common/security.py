"""Credentials on every gRPC channel (TLS, mutual TLS, bearer tokens) and who a caller is.

One `Security` value describes a component's credentials; the same fields serve
both ends. A controller given a certificate serves TLS; given a CA too, it
requires client certificates signed by that CA (mutual TLS). A client given a CA
verifies the controller's certificate; given its own certificate, presents it.
A token file adds a bearer token (for clusters that terminate TLS elsewhere, or
as a second factor): clients send its first token, a controller accepts the
tokens it lists. With none of this a channel is plaintext and every caller is
anonymous: authorization by session (controller/authz.py) still holds.

A caller's roles come from its certificate's organizational units (`recover
certs issue --role`) and from its token's line; with both, it holds the roles
both grant. Certificates are made with the `cryptography` library (cli/certs.py).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger("recover.security")

TOKEN_HEADER = "authorization"
ENV = {"cert": "RECOVER_TLS_CERT", "key": "RECOVER_TLS_KEY", "ca": "RECOVER_TLS_CA",
       "token_file": "RECOVER_TOKEN_FILE"}
"""Environment variables that stand in for the options (an option given wins)."""


class Role(StrEnum):
    """What a caller may do (controller/authz.py decides per RPC)."""

    AGENT = "agent"
    """Runs workers: holds an agent session."""
    READER = "reader"
    """Reads status, events and the run's report."""
    OPERATOR = "operator"
    """A reader that may also stop the job, drain a host and change the spares."""
    CONTROLLER = "controller"
    """A controller's own certificate (it serves; as a client it only reads)."""
    RELAY = "relay"
    """A rack's relay (`recover relay`): serves its agents' sessions and speaks for them to
    the leader, which believes the agent identities it names."""


ALL_ROLES = frozenset(Role)


class SecurityError(Exception):
    """Credentials that cannot be used: a missing file, a key without a certificate..."""


@dataclass(frozen=True)
class Security:
    """How a component proves who it is and checks its peers. All empty: plaintext."""

    cert: str = ""
    """PEM certificate of this component: a controller's server certificate, or a client's
    (agent, CLI) certificate for mutual TLS. Needs `key`."""
    key: str = ""
    """PEM private key of `cert`."""
    ca: str = ""
    """PEM CA certificate(s): a client verifies the controller's certificate against it; a
    controller with one requires client certificates it signed (mutual TLS)."""
    token_file: str = ""
    """Bearer tokens, one per line: `TOKEN [ROLE[,ROLE...] [SUBJECT]]` (no roles: every
    role). A client sends the first; a controller accepts each listed."""

    @property
    def tls(self) -> bool:
        return bool(self.cert or self.ca)

    @property
    def enabled(self) -> bool:
        return self.tls or bool(self.token_file)

    @property
    def authenticates_clients(self) -> bool:
        """A server with these settings knows who calls: client certificates (a CA) or tokens."""
        return bool(self.ca) or bool(self.token_file)

    def describe(self) -> str:
        parts = []
        if self.cert and self.ca:
            parts.append("mutual TLS")
        elif self.tls:
            parts.append("TLS")
        if self.token_file:
            parts.append("bearer token")
        return " + ".join(parts) or "plaintext"

    def check(self, what: str) -> None:
        """Raise SecurityError (naming `what`, e.g. "--tls-cert") for unusable settings."""
        if bool(self.cert) != bool(self.key):
            raise SecurityError(f"{what}: a TLS certificate needs its key and a key its "
                                "certificate (--tls-cert and --tls-key)")
        for name, path in (("--tls-cert", self.cert), ("--tls-key", self.key),
                           ("--tls-ca", self.ca), ("--token-file", self.token_file)):
            if path and not Path(path).is_file():
                raise SecurityError(f"{what}: {name} {path!r} is not a readable file")
        if self.cert:
            check_certificate(Path(self.cert), what)
            check_key_pair(Path(self.cert), Path(self.key), what)
        if self.ca:
            check_certificate(Path(self.ca), what)
        if self.token_file and not read_tokens(self.token_file):
            raise SecurityError(f"{what}: --token-file {self.token_file!r} holds no token")


PLAINTEXT = Security()
"""No credentials: the default of every component."""


def from_values(cert: str | None = None, key: str | None = None, ca: str | None = None,
                token_file: str | None = None,
                environ: Mapping[str, str] = os.environ) -> Security:
    """Options as given, each falling back to its environment variable."""
    given = {"cert": cert, "key": key, "ca": ca, "token_file": token_file}
    return Security(**{k: v if v is not None else environ.get(ENV[k], "")
                       for k, v in given.items()})


def check_certificate(path: Path, what: str) -> None:
    import datetime

    from cryptography import x509

    try:
        certs = x509.load_pem_x509_certificates(path.read_bytes())
    except ValueError:
        raise SecurityError(f"{what}: {path} is not a PEM certificate") from None
    now = datetime.datetime.now(datetime.UTC)
    for cert in certs:
        if cert.not_valid_after_utc < now:
            raise SecurityError(f"{what}: the certificate {cert.subject.rfc4514_string()} in "
                                f"{path} expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC")


def check_key_pair(cert: Path, key: Path, what: str) -> None:
    """The key must be the certificate's: gRPC would otherwise only log its own lines and
    fail every connection as if nobody answered."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        private = serialization.load_pem_private_key(key.read_bytes(), None)
    except TypeError:
        raise SecurityError(f"{what}: --tls-key {str(key)!r} is encrypted; it must be an "
                            "unencrypted PEM key (readable by its owner only)") from None
    except ValueError:
        raise SecurityError(f"{what}: --tls-key {str(key)!r} is not a PEM private key") from None
    if private.public_key() != x509.load_pem_x509_certificates(cert.read_bytes())[0].public_key():
        raise SecurityError(f"{what}: --tls-key {str(key)!r} is not the key of --tls-cert "
                            f"{str(cert)!r} (give the key file issued with that certificate)")


# ---------------------------------------------------------------- tokens


@dataclass(frozen=True)
class Token:
    digest: bytes
    """sha256 of the token: compared in constant time, never the token itself."""
    roles: frozenset[Role]
    subject: str


def warn_if_readable_by_others(path: str) -> None:
    """Tokens are passwords: say so when others than the owner can read the file (as ssh
    does for keys; a warning, because a shared secret store may set its own modes)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if mode & 0o077 and path not in _WARNED:
        _WARNED.add(path)
        log.warning("token file %s can be read by others than its owner (mode %o): "
                    "chmod 600 it", path, mode & 0o777)


_WARNED: set[str] = set()


def read_tokens(path: str) -> list[Token]:
    warn_if_readable_by_others(path)
    tokens = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        roles = ALL_ROLES
        if len(fields) > 1:
            try:
                roles = frozenset(Role(r) for r in fields[1].split(","))
            except ValueError:
                raise SecurityError(f"{path}:{number}: unknown role in {fields[1]!r} (roles: "
                                    f"{', '.join(Role)})") from None
        subject = fields[2] if len(fields) > 2 else f"token-{number}"
        tokens.append(Token(hashlib.sha256(fields[0].encode()).digest(), roles, subject))
    return tokens


def first_token(path: str) -> str:
    warn_if_readable_by_others(path)
    for line in Path(path).read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if fields:
            return fields[0]
    raise SecurityError(f"--token-file {path!r} holds no token")


def match_token(presented: str, accepted: Iterable[Token]) -> Token | None:
    """The accepted token equal to `presented`; every candidate is compared (in constant time),
    so the time taken says nothing about which one nearly matched."""
    digest = hashlib.sha256(presented.encode()).digest()
    found = None
    for token in accepted:
        if hmac.compare_digest(digest, token.digest):
            found = token
    return found


# ---------------------------------------------------------------- clients


class _Details(collections.namedtuple(
        "_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                     "compression")), grpc.ClientCallDetails):
    pass


def _with_token(details: Any, token: str, aio: bool) -> Any:
    metadata = [*(details.metadata or ()), (TOKEN_HEADER, f"Bearer {token}")]
    if aio:
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                          details.credentials, details.wait_for_ready)
    return _Details(details.method, details.timeout, metadata, details.credentials,
                    details.wait_for_ready, getattr(details, "compression", None))


class _SyncToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(_with_token(details, self._token, False), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(_with_token(details, self._token, False), request)

    def intercept_stream_unary(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return continuation(_with_token(details, self._token, False), requests)

    def intercept_stream_stream(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return continuation(_with_token(details, self._token, False), requests)


class _AioUnaryToken(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(_with_token(details, self._token, True), request)


class _AioStreamToken(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_stream_stream(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return await continuation(_with_token(details, self._token, True), requests)


def _channel_credentials(security: Security) -> grpc.ChannelCredentials:
    def read(path: str) -> bytes | None:
        return Path(path).read_bytes() if path else None

    return grpc.ssl_channel_credentials(root_certificates=read(security.ca),
                                        private_key=read(security.key),
                                        certificate_chain=read(security.cert))


def channel(address: str, security: Security,
            options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
    """A blocking client channel to a controller with these credentials."""
    if security.tls:
        ch = grpc.secure_channel(address, _channel_credentials(security), options=options)
    else:
        ch = grpc.insecure_channel(address, options=options)
    if security.token_file:
        ch = grpc.intercept_channel(ch, _SyncToken(first_token(security.token_file)))
    return ch


def aio_channel(address: str, security: Security,
                options: list[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
    """An asyncio client channel to a controller with these credentials."""
    interceptors: list[Any] = []
    if security.token_file:
        token = first_token(security.token_file)
        interceptors = [_AioUnaryToken(token), _AioStreamToken(token)]
    if security.tls:
        return grpc.aio.secure_channel(address, _channel_credentials(security), options=options,
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


# ---------------------------------------------------------------- servers


def server_credentials(security: Security) -> grpc.ServerCredentials:
    """TLS with this controller's certificate; with a CA, client certificates required."""
    ca = Path(security.ca).read_bytes() if security.ca else None
    return grpc.ssl_server_credentials(
        [(Path(security.key).read_bytes(), Path(security.cert).read_bytes())],
        root_certificates=ca, require_client_auth=ca is not None)


@dataclass(frozen=True)
class Identity:
    """Who a caller proved to be, and the roles that grants."""

    subject: str
    roles: frozenset[Role]
    proof: str
    """"certificate", "token", both joined by "+", or "none" (plaintext, anonymous)."""


ANONYMOUS = Identity("anonymous", ALL_ROLES, "none")


def certificate_identity(pem: bytes) -> tuple[str, frozenset[Role]]:
    """(common name, roles from the organizational units) of a client certificate."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cert = x509.load_pem_x509_certificate(pem)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    units = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    roles = frozenset(Role(str(u.value)) for u in units if str(u.value) in set(Role))
    return (str(names[0].value) if names else cert.subject.rfc4514_string()), roles


class Authenticator:
    """The controller's side: who is calling (`identify`), from its certificate and token."""

    def __init__(self, security: Security) -> None:
        self.security = security
        self._tokens = read_tokens(security.token_file) if security.token_file else []
        self._client_certs = bool(security.cert and security.ca)

    def identify(self, auth_context: Mapping[str, Iterable[bytes]],
                 metadata: Iterable[tuple[str, str | bytes]]) -> Identity | str:
        """The caller's identity, or why it has none (then refuse it as UNAUTHENTICATED)."""
        if not self._client_certs and not self._tokens:
            return ANONYMOUS
        subject, roles, proofs = "", ALL_ROLES, []
        if self._client_certs:
            pem = next(iter(auth_context.get("x509_pem_cert", ())), None)
            if pem is None:
                return "no client certificate (this controller requires mutual TLS)"
            subject, roles = certificate_identity(pem)
            proofs.append("certificate")
        if self._tokens:
            header = next((v for k, v in metadata if k == TOKEN_HEADER), None)
            if isinstance(header, bytes):
                header = header.decode(errors="replace")
            if not header or not header.startswith("Bearer "):
                return "no bearer token (this controller requires one: --token-file)"
            token = match_token(header[len("Bearer "):], self._tokens)
            if token is None:
                return "the bearer token is not one this controller accepts"
            subject = subject or token.subject
            roles = roles & token.roles
            proofs.append("token")
        return Identity(subject, roles, "+".join(proofs))
