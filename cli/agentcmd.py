"""`recover agent`: one host's workers (agent/daemon.py), and the restart flags `recover run`
passes on to its agents."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from recover.agent.restarts import RESTART_WINDOW_S
from recover.cli.access import add_security_arguments, security_from_args
from recover.cli.jobargs import UsageError, parse_addresses, positive_seconds, restart_count


def add_restart_arguments(parser: argparse.ArgumentParser) -> None:
    """How the agents start and restart workers (`recover run` passes them on)."""
    parser.add_argument("--cold-start", action="store_true",
                        help="start every worker as a fresh process instead of forking it from "
                             "the agent's warm interpreter (which has imported torch once)")
    parser.add_argument("--max-restarts", type=restart_count, default=3,
                        help="times each slot's worker is replaced after it dies, with backoff, "
                             "within --restart-window (default 3; 0: never)")
    parser.add_argument("--restart-window", type=positive_seconds, default=RESTART_WINDOW_S,
                        help="seconds after which a restart no longer counts against its slot "
                             f"(default {RESTART_WINDOW_S:.0f})")


def add_parser(sub: Any) -> None:
    agent = sub.add_parser("agent", help="run one host's workers",
                           usage="recover agent --controller HOST:PORT --slots N [-- COMMAND ...]")
    agent.add_argument("--controller", required=True,
                       help="HOST:PORT of the controller, or HOST:PORT,HOST:PORT,... of every "
                            "controller of the job (the agent follows the leader)")
    agent.add_argument("--slots", type=int, default=1,
                       help="worker slots on this host (a multiple of the job's "
                            "--ranks-per-replica, or a divisor of it: then each replica spans "
                            "agents of this size)")
    agent.add_argument("--agent-id", default=None, help="unique name (default: host + random)")
    agent.add_argument("--log-dir", default=None, help="write worker output to LOG_DIR/replica-N.log")
    agent.add_argument("--metrics-port", type=int, default=None,
                       help="serve Prometheus metrics on METRICS_HOST:PORT/metrics (0: any free "
                            "port)")
    agent.add_argument("--metrics-host", default="127.0.0.1",
                       help="address the metrics endpoint listens on (default 127.0.0.1)")
    agent.add_argument("--metrics-port-file", default=None,
                       help="write the metrics endpoint's port here once it listens")
    agent.add_argument("--connect-timeout", type=positive_seconds, default=10.0,
                       help="seconds to wait for the controller at start")
    agent.add_argument("--attach", type=int, default=None, metavar="PID",
                       help=argparse.SUPPRESS)  # the single-process mode (trainer/standalone.py)
    agent.add_argument("--attach-file", default=None, help=argparse.SUPPRESS)
    add_restart_arguments(agent)
    add_security_arguments(agent)
    agent.add_argument("worker_command", nargs=argparse.REMAINDER,
                       help="after --: the worker command (default: the job's, set on the "
                            "controller)")


def run(args: argparse.Namespace) -> int:
    from recover.agent.config import AgentConfig, AgentError
    from recover.agent.daemon import Agent
    from recover.common import logs

    parse_addresses(args.controller)
    if args.slots < 1:
        raise UsageError(f"--slots must be at least 1, got {args.slots}")
    command = args.worker_command[1:] if args.worker_command[:1] == ["--"] else args.worker_command
    security = security_from_args(args, "agent")
    logs.configure("agent")
    config = AgentConfig(controller=args.controller, slots=args.slots,
                         command=command or None, log_dir=args.log_dir,
                         connect_timeout_s=args.connect_timeout, metrics_port=args.metrics_port,
                         metrics_host=args.metrics_host, metrics_port_file=args.metrics_port_file,
                         max_restarts=args.max_restarts, warm_start=not args.cold_start,
                         attach_pid=args.attach, attach_file=args.attach_file,
                         restart_window_s=args.restart_window, security=security,
                         **({"agent_id": args.agent_id} if args.agent_id else {}))
    try:
        return asyncio.run(Agent(config).run())
    except AgentError as exc:
        print(f"recover agent: {exc}", file=sys.stderr)
        return 1
