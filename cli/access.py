"""Command-line access options: credentials (--tls-*, --token-file) and the operator
commands that use them (`recover stop`, `recover drain`, `recover spares`)."""

from __future__ import annotations

import argparse
import sys

import grpc

from recover.cli.jobargs import UsageError, positive_seconds
from recover.common.security import Security, SecurityError, from_values
from recover.proto import pb

SECURITY_HELP = {
    "tls_cert": "PEM certificate of this component (a controller's server certificate, or a "
                "client certificate for mutual TLS; env RECOVER_TLS_CERT)",
    "tls_key": "PEM private key of --tls-cert (env RECOVER_TLS_KEY)",
    "tls_ca": "PEM CA certificate: clients verify the controller with it; a controller given "
              "one requires client certificates it signed (env RECOVER_TLS_CA)",
    "token_file": "bearer tokens, one per line `TOKEN [ROLES [SUBJECT]]`: a client sends the "
                  "first, a controller accepts each (env RECOVER_TOKEN_FILE)",
}


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security (README: Securing a cluster)")
    for name, text in SECURITY_HELP.items():
        group.add_argument("--" + name.replace("_", "-"), default=None, metavar="FILE", help=text)


def security_from_args(args: argparse.Namespace, command: str) -> Security:
    """The credentials from the options (or the environment), checked: UsageError if unusable."""
    security = from_values(args.tls_cert, args.tls_key, args.tls_ca, args.token_file)
    try:
        security.check(f"recover {command}")
    except SecurityError as exc:
        raise UsageError(str(exc)) from None
    return security


def add_operator_parsers(sub: argparse._SubParsersAction) -> None:
    for name, text in (("stop", "stop a job at the next step boundary (summary and checkpoint "
                                "as when it ends)"),
                       ("drain", "take an agent's replicas out of a job at the next step "
                                 "boundary, then stop the agent"),
                       ("spares", "set how many hot spares a job keeps")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--controller", default="127.0.0.1:50051",
                       help="HOST:PORT, or a comma-separated list (the leader among them acts)")
        p.add_argument("--timeout", type=positive_seconds, default=10.0,
                       help="seconds to wait for the controller to answer")
        if name == "drain":
            p.add_argument("agent_id", help="the agent to drain (`recover events` names them)")
        if name == "spares":
            p.add_argument("count", type=int, help="hot spares to keep (0: none)")
        if name != "spares":
            p.add_argument("--reason", default="", help="why (recorded in the job's events)")
        add_security_arguments(p)


def run_operator(args: argparse.Namespace) -> int:
    from recover.cli.inspect import connect_or_say

    connected = connect_or_say(args.command, args.controller, args.timeout,
                               security_from_args(args, args.command))
    if connected is None:
        return 1
    channel, stub = connected
    try:
        if args.command == "stop":
            reply = stub.Stop(pb.StopRequest(reason=args.reason), timeout=args.timeout)
        elif args.command == "drain":
            reply = stub.Drain(pb.DrainRequest(agent_id=args.agent_id, reason=args.reason),
                               timeout=args.timeout)
        else:
            reply = stub.SetSpares(pb.SparesRequest(spares=args.count), timeout=args.timeout)
    except grpc.RpcError as exc:
        print(f"recover {args.command}: the controller refused: {exc.code().name}: "  # type: ignore[attr-defined]
              f"{exc.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    finally:
        channel.close()
    print(f"recover {args.command}: {'accepted' if reply.accepted else 'refused'}: {reply.reason}",
          file=sys.stdout if reply.accepted else sys.stderr)
    return 0 if reply.accepted else 1
