"""`recover relay`: a rack's relay between its agents and the leader (relay/server.py)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from recover.cli.access import add_security_arguments, security_from_args
from recover.cli.jobargs import UsageError, parse_address, parse_addresses, positive_seconds


def add_parser(sub: Any) -> None:
    relay = sub.add_parser(
        "relay", help="carry one rack's agent sessions to the leader over one stream",
        usage="recover relay --controller HOST:PORT[,...] [--listen HOST:PORT]",
        description="Agents of the rack name this relay first in their --controller list; the "
                    "leader then handles one stream per rack instead of one per agent (README: "
                    "Relays for large jobs).")
    relay.add_argument("--controller", required=True,
                       help="HOST:PORT of every controller of the job, comma-separated")
    relay.add_argument("--listen", default="127.0.0.1:0",
                       help="HOST:PORT for the rack's agents (port 0: any free one; default "
                            "%(default)s)")
    relay.add_argument("--relay-id", default=None, help="name in the leader's log "
                                                        "(default: relay-HOSTNAME)")
    relay.add_argument("--port-file", default=None, help="write the listening port here")
    relay.add_argument("--leader-timeout", type=positive_seconds, default=2.0,
                       help="seconds of the leader's silence before the agents are sent to look "
                            "for it again (default %(default)s)")
    relay.add_argument("--agents-by-token", action="store_true",
                       help="agents prove themselves with tokens (--token-file) only: --tls-ca "
                            "checks the controllers but no client certificate is asked of the "
                            "agents (a controller given a CA asks for one)")
    add_security_arguments(relay)


def run(args: argparse.Namespace) -> int:
    from recover.common import logs
    from recover.relay.server import RelayConfig, serve

    controllers = parse_addresses(args.controller)
    if args.listen.endswith(":0"):
        host = args.listen[:-2]
        port = 0
    else:
        host, _, port_text = parse_address(args.listen, "--listen").rpartition(":")
        port = int(port_text)
    if not host:
        raise UsageError(f"--listen {args.listen!r} is not HOST:PORT")
    security = security_from_args(args, "relay")
    if args.agents_by_token and not security.token_file:
        raise UsageError("recover relay: --agents-by-token needs --token-file (the agents' "
                         "tokens, after the relay's own on the first line)")
    if security.tls and not security.cert:
        raise UsageError("recover relay: serving TLS needs --tls-cert and --tls-key (a "
                         "certificate with the relay role: `recover certs issue DIR NAME "
                         "--role relay --host HOST`)")
    logs.configure("relay")
    config = RelayConfig(controllers=controllers, host=host, port=port, security=security,
                         leader_timeout_s=args.leader_timeout, port_file=args.port_file,
                         agents_by_token=args.agents_by_token,
                         **({"relay_id": args.relay_id} if args.relay_id else {}))
    try:
        return asyncio.run(serve(config))
    except OSError as exc:
        print(f"recover relay: {exc}", file=sys.stderr)
        return 1
