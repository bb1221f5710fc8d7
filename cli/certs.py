"""`recover certs`: a certificate authority and per-component certificates for a cluster.

    recover certs init DIR                       # DIR/ca.pem, DIR/ca-key.pem
    recover certs issue DIR controller --role controller --host ctl.example --host 10.0.0.5
    recover certs issue DIR host0 --role agent   # DIR/host0.pem, DIR/host0-key.pem
    recover certs issue DIR alice --role operator
    recover certs token --role reader --subject grafana   # a line for a --token-file

The `cryptography` library does the work (EC P-256 keys, SHA-256 signatures). A
certificate's organizational units carry its roles (common/security.py); its common
name is the identity an agent is bound to. Private keys are written 0600 and never
overwritten.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import re
import secrets
from pathlib import Path

from recover.cli.jobargs import UsageError
from recover.common.security import Role

DEFAULT_DAYS = 365
MAX_DAYS = 36500
"""A hundred years: beyond that a validity is a typo (and soon past X.509's year 9999)."""
MAX_NAME = 64
"""X.509's upper bound on a common name."""
CA_CERT, CA_KEY = "ca.pem", "ca-key.pem"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
SUBJECT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]*")
DNS_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def valid_host(host: str) -> bool:
    """An IP address, or a DNS name (a leading `*.` wildcard allowed)."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    labels = host.removeprefix("*.").split(".")
    if all(label.isdigit() for label in labels):
        return False  # digits and dots only: a mistyped IP address, not a DNS name
    return len(host) <= 253 and all(DNS_LABEL.fullmatch(label) for label in labels)


def add_parser(sub: argparse._SubParsersAction) -> None:
    certs = sub.add_parser("certs", help="make a CA, certificates and tokens for a cluster")
    verbs = certs.add_subparsers(dest="certs_command", required=True)
    init = verbs.add_parser("init", help="create a certificate authority in DIR")
    init.add_argument("dir")
    init.add_argument("--name", default="ReCoVer CA", help="the CA's common name")
    init.add_argument("--days", type=int, default=3650, help="validity (default 3650)")
    issue = verbs.add_parser("issue", help="issue a certificate signed by DIR's CA")
    issue.add_argument("dir")
    issue.add_argument("name", help="common name: the identity (an agent id, a user)")
    issue.add_argument("--role", action="append", choices=[str(r) for r in Role], required=True,
                       help="a role it holds (repeatable)")
    issue.add_argument("--host", action="append", default=[],
                       help="a DNS name or IP address it serves on (controllers; repeatable; "
                            "default localhost and 127.0.0.1)")
    issue.add_argument("--days", type=int, default=DEFAULT_DAYS,
                       help=f"validity (default {DEFAULT_DAYS})")
    token = verbs.add_parser("token", help="print a new bearer token line for a --token-file")
    token.add_argument("--role", action="append", choices=[str(r) for r in Role], default=[],
                       help="a role it grants (repeatable; default: every role)")
    token.add_argument("--subject", default="", help="who holds it (shown in events)")


def run(args: argparse.Namespace) -> int:
    if args.certs_command == "token":
        if args.subject and not SUBJECT.fullmatch(args.subject):
            raise UsageError(f"recover certs: --subject {args.subject!r}: one word of letters, "
                             "digits, '.', '_', '@' and '-' (it is the line's third field)")
        roles = ",".join(args.role) if args.role else ",".join(Role)
        print(f"{secrets.token_urlsafe(32)} {roles} {args.subject or 'token'}")
        return 0
    if not 1 <= args.days <= MAX_DAYS:
        raise UsageError(f"recover certs: --days must be 1..{MAX_DAYS}, got {args.days}")
    folder = Path(args.dir)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"recover certs: {args.dir!r} is a file, not a folder")
    if args.certs_command == "issue" and not NAME.fullmatch(args.name):
        raise UsageError(f"recover certs: {args.name!r} is not a name for a certificate (letters, "
                         "digits, '.', '_' and '-')")
    if not 1 <= len(args.name) <= MAX_NAME or not args.name.isprintable():
        shown = repr(args.name) if len(args.name) <= 20 else f"{args.name[:20]!r}..."
        raise UsageError(f"recover certs: the name {shown} must be 1 to {MAX_NAME} printable "
                         "characters (an X.509 common name)")
    try:
        if args.certs_command == "init":
            cert, key = init_ca(folder, args.name, args.days)
            print(f"recover certs: created the CA {cert} (key {key}: keep it off the cluster)")
            return 0
        hosts = args.host or (["localhost", "127.0.0.1"] if {"controller", "relay"} & set(args.role)
                          else [])
        bad = [host for host in hosts if not valid_host(host)]
        if bad:
            raise UsageError(f"recover certs: --host {bad[0]!r} is neither an IP address nor a "
                             "DNS name")
        roles = list(dict.fromkeys(args.role))  # each once, in the order given
        cert, key = issue(folder, args.name, [Role(r) for r in roles], hosts, args.days)
    except OSError as exc:
        raise UsageError(f"recover certs: {exc.filename or args.dir}: "
                         f"{exc.strerror or exc}") from None
    from cryptography import x509

    end = x509.load_pem_x509_certificate(cert.read_bytes()).not_valid_after_utc
    capped = end < datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=args.days - 1)
    print(f"recover certs: issued {cert} and {key} for {args.name} "
          f"(roles {', '.join(roles)}{'; hosts ' + ', '.join(hosts) if hosts else ''}; valid "
          f"until {end:%Y-%m-%d}{', when the CA ends: a certificate cannot outlive it' if capped else ''})")
    return 0


def _write_pair(key_path: Path, key_pem: bytes, cert_path: Path, cert_pem: bytes) -> None:
    """Write a key (0600) and its certificate, both new, or neither: a key left beside
    another key's certificate would pass for a pair and fail every handshake."""
    for path in (key_path, cert_path):
        if path.exists() or path.is_symlink():
            raise UsageError(f"recover certs: {path} exists; not overwriting it (nor writing "
                             f"its {'certificate' if path == key_path else 'key'})")
    written: list[Path] = []
    try:
        for path, data, mode in ((key_path, key_pem, 0o600), (cert_path, cert_pem, 0o644)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            written.append(path)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise


def init_ca(folder: Path, name: str, days: int) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    key_path, cert_path = folder / CA_KEY, folder / CA_CERT
    _write_pair(key_path, key.private_bytes(serialization.Encoding.PEM,
                                            serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption()),
                cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def issue(folder: Path, name: str, roles: list[Role], hosts: list[str], days: int, *,
          not_before: datetime.datetime | None = None,
          not_after: datetime.datetime | None = None) -> tuple[Path, Path]:
    """A certificate for `name` signed by the CA in `folder`, usable as a client certificate,
    and as a server certificate only for a controller or a certificate that names `hosts`
    it serves on (an etcd member): TLS clients refuse a server certificate without that
    purpose, so an agent's or an operator's certificate cannot pose as a controller.
    (`not_before`/`not_after`: for tests of certificates not yet or no longer valid.)"""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    try:
        ca_key = serialization.load_pem_private_key((folder / CA_KEY).read_bytes(), None)
        ca_cert = x509.load_pem_x509_certificate((folder / CA_CERT).read_bytes())
    except FileNotFoundError:
        raise UsageError(f"recover certs: no CA in {folder} (run `recover certs init "
                         f"{folder}` first)") from None
    except (ValueError, TypeError) as exc:
        raise UsageError(f"recover certs: the CA in {folder} does not load ({CA_KEY} and "
                         f"{CA_CERT} must be what `recover certs init` made): "
                         f"{str(exc).splitlines()[0]}") from None
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise UsageError(f"recover certs: {folder / CA_KEY} is not a key `recover certs init` made")
    if ca_key.public_key() != ca_cert.public_key():
        raise UsageError(f"recover certs: {folder / CA_KEY} is not the key of {folder / CA_CERT} "
                         "(a certificate it signed would not verify)")
    ca_end = ca_cert.not_valid_after_utc
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    serves = {Role.CONTROLLER, Role.RELAY} & set(roles) or hosts  # a server to its clients
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if serves
              else [ExtendedKeyUsageOID.CLIENT_AUTH])
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name),
                         *(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, str(r))
                           for r in roles)])
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(not_before or now - datetime.timedelta(minutes=5))
               .not_valid_after(not_after or min(now + datetime.timedelta(days=days), ca_end))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}-key.pem"
    _write_pair(key_path, key.private_bytes(serialization.Encoding.PEM,
                                            serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption()),
                cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path
