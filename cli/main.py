"""`recover`: one console script, one subcommand per role.

    recover run         all-in-one local job (controller + agents + workers)
    recover controller  the central controller of a job
    recover agent       one per host: runs that host's workers
    recover status      a running job's state
    recover events      a running job's event log
    recover summary     a job's summary.json, fetched from its controller
    recover stop        stop a job at the next step boundary (operators)
    recover drain       take an agent's replicas out of a job (operators)
    recover spares      set a job's hot spares (operators)
    recover certs       a CA, certificates and tokens for a cluster
    recover verify      compare two runs' ledgers and parameter digests step by step
    recover plot        draw loss per step of several runs, failures marked
    recover bench       benchmarks: throughput, recovery, overhead, controller, simulator

User mistakes end in one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

# gRPC's own INFO lines (a refused handshake...) would precede the one line a client prints
# about it, so clients quiet them; a controller keeps them: they are its side of a refused
# handshake. Quieting is marked, so that a controller started by a quieted process (`recover
# run`, a test) undoes it rather than inherit it; a GRPC_VERBOSITY the user set is left alone.
if sys.argv[1:2] == ["controller"]:
    if os.environ.pop("RECOVER_QUIETED_GRPC", None) is not None:
        os.environ.pop("GRPC_VERBOSITY", None)
elif "GRPC_VERBOSITY" not in os.environ:
    os.environ["GRPC_VERBOSITY"] = "ERROR"
    os.environ["RECOVER_QUIETED_GRPC"] = "1"

from recover.cli import agentcmd, bench, certs, export, jobfile, relaycmd
from recover.cli.access import (
    add_operator_parsers,
    add_security_arguments,
    run_operator,
    security_from_args,
)
from recover.cli.jobargs import (
    Parser,
    SettingUsageError,
    UsageError,
    add_job_arguments,
    bounded_count,
    job_from_args,
    parse_address,
    parse_addresses,
    positive_seconds,
)
from recover.common.lifetime import die_with_parent
from recover.controller.rendezvous import MAX_KEYS, MAX_MB

JOB_COMMANDS = (("run",), ("controller",), ("bench", "throughput"), ("bench", "overhead"))
"""Subcommands that take job flags (and a `--job FILE`)."""


def build_parser() -> Parser:
    parser = Parser(prog="recover", description="Fault-tolerant data-parallel training that keeps "
                    "every step's global batch intact.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True

    run = sub.add_parser("run", help="train locally: controller, agents and workers on this machine")
    add_job_arguments(run)
    run.add_argument("--agents", type=int, default=None,
                     help="agents (emulated hosts) to spread the replicas over (default: 2); "
                          "more agents than replicas: each replica spans agents/replicas of "
                          "them (--ranks-per-replica divided evenly over them)")
    run.add_argument("--out", default="runs/latest", help="where summary.json and logs go")
    run.add_argument("--quiet", action="store_true", help="no live progress display")
    run.add_argument("--no-plot", action="store_true",
                     help="do not draw OUT/plot.png (the run against wall time) at the end")
    run.add_argument("--attach", type=int, default=None, metavar="PID",
                     help=argparse.SUPPRESS)  # the single-process mode (trainer/standalone.py)
    run.add_argument("--store", default="memory://",
                     help="controller state store: memory:// (default), etcd://HOST:PORT[,...] or "
                          "etcds://HOST:PORT[,...]?ca=F&cert=F&key=F[&server_name=N][&user=U&password_file=F]")
    run.add_argument("--store-timeout", type=positive_seconds, default=10.0,
                     help="seconds the store gets to answer before the run gives up (default 10)")
    bench.add_run_mode_arguments(run)
    run.add_argument("--start-timeout", type=positive_seconds, default=120.0,
                     help="seconds the workers get to build their models and report ready")
    agentcmd.add_restart_arguments(run)
    run.add_argument("--start-grace", type=positive_seconds, default=10.0,
                     help="after a worker failed during startup: seconds its replacement gets "
                          "before the job starts without it (default 10)")
    run.add_argument("--resume", default=None, metavar="DIR",
                     help="restart a job that lost every replica from its newest authentic "
                          "checkpoint in DIR: give the job's flags and command again (those "
                          "that decide the trajectory are checked against the checkpoint)")
    run.add_argument("--tls", action="store_true",
                     help="mutual TLS between every component of the local job (a throwaway "
                          "CA and certificates in OUT/tls)")
    run.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                     help="serve Prometheus metrics from every controller and agent of the job: "
                          "on PORT, PORT+1, ... (controllers first), or on free ports with 0; "
                          "the addresses are printed, in summary.json and in "
                          "OUT/prometheus-targets.json (for Prometheus' file_sd_configs)")
    run.add_argument("--controllers", type=int, default=1,
                     help="controller processes (one leads, the others stand by; needs an etcd "
                          "--store when more than 1)")
    run.add_argument("--relays", type=int, default=0,
                     help="rack relays (`recover relay`) between the agents and the controllers, "
                          "the agents spread over them (default 0: agents reach the controllers "
                          "directly)")

    ctl = sub.add_parser("controller", help="run the controller of a job")
    add_job_arguments(ctl)
    ctl.add_argument("--host", default="127.0.0.1", help="address to listen on and advertise")
    ctl.add_argument("--insecure", action="store_true",
                     help="allow TLS without client authentication (no --tls-ca, no tokens) on "
                          "a non-loopback address, where every caller gets every role")
    ctl.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
    ctl.add_argument("--port-file", default=None, help="write the chosen port here")
    ctl.add_argument("--store", default="memory://",
                     help="state store: memory:// (default), etcd://HOST:PORT[,HOST:PORT...] or "
                          "etcds://... (TLS; see recover controller --help)")
    ctl.add_argument("--insecure-store", action="store_true",
                     help="allow a plaintext etcd:// store on another machine (whoever reaches "
                          "it chooses the job's leader: only on a network nobody else reaches)")
    ctl.add_argument("--store-timeout", type=positive_seconds, default=10.0,
                     help="seconds the store gets to answer at start before giving up (default 10)")
    ctl.add_argument("--metrics-port", type=int, default=None,
                     help="serve Prometheus metrics on this port (0: any free port); HTTPS "
                          "under TLS, with client certificates when --tls-ca is given")
    ctl.add_argument("--metrics-host", default=None,
                     help="address the metrics endpoint listens on (default: --host)")
    ctl.add_argument("--metrics-port-file", default=None,
                     help="write the metrics endpoint's port here once it listens")
    ctl.add_argument("--metrics-plain", action="store_true",
                     help="serve metrics over plain HTTP even under TLS (for a scraper on a "
                          "trusted network; by default HTTPS, with client certificates when "
                          "--tls-ca is given)")
    ctl.add_argument("--agent-timeout", type=positive_seconds, default=3.0,
                     help="seconds of heartbeat silence before an agent is declared lost")
    ctl.add_argument("--start-timeout", type=positive_seconds, default=120.0,
                     help="seconds to wait for every replica to be ready")
    ctl.add_argument("--linger", type=positive_seconds, default=None,
                     help="exit this many seconds after the job ends (default: keep serving)")
    ctl.add_argument("--advertise", default=None,
                     help="HOST:PORT agents reach this controller at (default: --host and the port)")
    ctl.add_argument("--controller-id", default=None,
                     help="this controller's name in the leader election (default: host-pid)")
    ctl.add_argument("--lease-ttl", type=int, default=2,
                     help="leader lease TTL in whole seconds (a crashed leader is replaced after it)")
    ctl.add_argument("--start-grace", type=positive_seconds, default=10.0,
                     help="after a worker failed during startup: seconds its replacement gets "
                          "before the job starts with --min-replicas (default 10)")
    ctl.add_argument("--resume", default=None, metavar="DIR|FILE",
                     help="start the job from a checkpoint folder's newest authentic checkpoint "
                          "(or a file), at its step: the job is these flags and command, "
                          "checked against the checkpoint's")
    ctl.add_argument("--summary-out", default=None, metavar="DIR",
                     help="write DIR/summary.json when the job ends (as `recover run` does)")
    ctl.add_argument("--rendezvous-max-mb", type=bounded_count(4, 1 << 20), default=MAX_MB,
                     help="memory the rendezvous store may take in beyond its own; at half of "
                          "it the store is reset (default %(default)s)")
    ctl.add_argument("--rendezvous-max-keys", type=bounded_count(1000, 1 << 30),
                     default=MAX_KEYS,
                     help="keys the rendezvous store may hold before it is reset "
                          "(default %(default)s)")
    add_security_arguments(ctl)

    agentcmd.add_parser(sub)

    for name, helptext in (("status", "show a running job's state"),
                           ("events", "show a running job's events")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--controller", default="127.0.0.1:50051",
                       help="HOST:PORT, or a comma-separated list (the leader among them answers)")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument("--timeout", type=positive_seconds, default=5.0,
                       help="seconds to wait for the controller to answer")
        if name == "events":
            p.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
        add_security_arguments(p)
    summary = sub.add_parser("summary", help="write a job's summary.json, fetched from its controller")
    summary.add_argument("--controller", default="127.0.0.1:50051",
                         help="HOST:PORT, or a comma-separated list (the leader among them answers)")
    summary.add_argument("--out", required=True, metavar="DIR", help="where summary.json goes")
    summary.add_argument("--timeout", type=positive_seconds, default=10.0,
                         help="seconds to wait for the controller to answer")
    add_security_arguments(summary)
    add_operator_parsers(sub)
    certs.add_parser(sub)
    relaycmd.add_parser(sub)
    verify = sub.add_parser("verify", help="compare two runs step by step (samples, parameters)")
    verify.add_argument("run_a", help="a run directory (with summary.json) or a summary.json")
    verify.add_argument("run_b")
    verify.add_argument("--loss-rtol", type=float, default=0.0,
                        help="tolerated relative loss difference (default 0: exact); for runs "
                             "in fast mode, which promises the loss to float rounding, not the "
                             "same bits, parameters are then not compared (1e-4: its promise)")

    export.add_parser(sub)
    plot = sub.add_parser("plot", help="plot loss per step of runs (the first is the reference)")
    plot.add_argument("runs", nargs="+", help="run directories or summary.json files")
    plot.add_argument("--out", required=True, help="PNG file to write")
    plot.add_argument("--x", choices=["step", "time"], default="step",
                      help="the horizontal axis: step (loss difference from the first run) or "
                           "wall time (steps, live replicas, tokens/s; recoveries, joins and "
                           "a ckpt-restart run's restarts shaded)")
    plot.add_argument("--label", action="append", default=None,
                      help="legend label per run, in order (repeatable)")
    bench.add_bench_parser(sub)
    return parser


def job_parser(parser: Parser, path: tuple[str, ...]) -> Parser:
    """The parser of a (sub)subcommand, e.g. ('bench', 'throughput')."""
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
        parser = sub.choices[name]
    return parser


def _run_controller(args: argparse.Namespace) -> int:
    from recover.common import logs
    from recover.controller.server import ControllerConfig, serve

    job = job_from_args(args)
    # A job handed over by `recover run` was resumed (and checked) there already.
    if args.resume is not None and args.job_proto is None:
        from recover.cli.resume import resumed_job

        job, notes = resumed_job(args.resume, job, job_id_given=args.job_id is not None,
                                 checkpoint_dir_given=args.checkpoint_dir is not None)
        for note in notes:
            print(f"recover controller: {note}", file=sys.stderr)
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port {args.port} is not a port number")
    if args.advertise is not None:
        parse_address(args.advertise, "--advertise")
    from recover.cli.preflight import check_host, check_store

    check_host(args.host)
    if not 2 <= args.lease_ttl <= 60:
        raise UsageError(f"--lease-ttl must be 2..60 seconds, got {args.lease_ttl}")
    from recover.common.netaddr import is_loopback
    from recover.controller.store_url import store_exposure

    store = store_exposure(args.store, insecure_store=args.insecure_store,
                           is_loopback=is_loopback)
    if not store.allowed:
        raise UsageError(f"recover controller: {store.reason}")
    check_store(args.store, "recover controller", args.store_timeout)
    security = security_from_args(args, "controller")
    if security.tls and not security.cert:
        raise UsageError("recover controller: serving TLS needs --tls-cert and --tls-key "
                         "(--tls-ca alone is what clients use)")
    if (security.tls and not security.authenticates_clients and not is_loopback(args.host)
            and not args.insecure):
        # Encrypted, so it looks secured, yet every caller gets every role: refuse the trap.
        raise UsageError(f"recover controller: --host {args.host} with TLS but neither "
                         "--tls-ca nor --token-file would let anyone who reaches it act as an "
                         "agent or operator; add --tls-ca (mutual TLS) or tokens, or say "
                         "--insecure")
    logs.configure("controller")
    if store.reason:
        logging.getLogger("recover.controller").warning("%s", store.reason)
    config = ControllerConfig(host=args.host, port=args.port, port_file=args.port_file,
                              store_url=args.store, agent_timeout_s=args.agent_timeout,
                              start_timeout_s=args.start_timeout, linger_s=args.linger,
                              metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                              metrics_port_file=args.metrics_port_file,
                              metrics_plain=args.metrics_plain, advertise=args.advertise,
                              controller_id=args.controller_id, lease_ttl_s=args.lease_ttl,
                              summary_dir=args.summary_out, start_grace_s=args.start_grace,
                              rendezvous_max_mb=args.rendezvous_max_mb,
                              rendezvous_max_keys=args.rendezvous_max_keys, security=security)
    try:
        return asyncio.run(serve(config, job))
    except OSError as exc:
        print(f"recover controller: {exc}", file=sys.stderr)
        return 1


def _end_with_launcher() -> None:
    """Started by `recover run`: end when it ends, even SIGKILLed (no orphaned job)."""
    parent = os.environ.get("RECOVER_PARENT_PID", "")
    if parent.isdigit() and not die_with_parent(int(parent), signal.SIGTERM):
        print("recover: the launcher is gone; not starting", file=sys.stderr)
        raise SystemExit(1)


def _innermost(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (sub)command parser `argv` names, so that a stray flag is reported by the command
    it was given to (`recover run: unrecognized arguments`), not by `recover`."""
    words = iter(argv)
    while True:
        commands = next((action.choices for action in parser._actions
                         if isinstance(action, argparse._SubParsersAction)), None)
        word = next((w for w in words if not w.startswith("-")), None) if commands else None
        if commands is None or word not in commands:
            return parser
        parser = commands[word]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["controller"], ["agent"], ["relay"]):
        _end_with_launcher()
    parser = build_parser()
    applied: jobfile.Applied | None = None
    args: argparse.Namespace | None = None
    try:
        for path in JOB_COMMANDS:
            if tuple(argv[:len(path)]) == path:
                applied = jobfile.apply(job_parser(parser, path), argv[len(path):])
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            _innermost(parser, argv).error(f"unrecognized arguments: {' '.join(unknown)}")
        if args.command == "run" and args.mode == "ckpt-restart":
            return bench.run_ckpt_restart(args)
        if args.command == "run":
            if args.schedule is not None:
                raise UsageError("recover run: --schedule goes with --mode ckpt-restart (for "
                                 "ReCoVer under a schedule use `recover bench throughput`)")
            baseline_only = [flag for flag, value in (
                ("--ckpt-every-steps", args.ckpt_every_steps), ("--ckpt-every-s", args.ckpt_every_s),
                ("--mtbf", args.mtbf)) if value is not None]
            if baseline_only:
                raise UsageError(f"recover run: {baseline_only[0]} is the checkpoint-and-restart "
                                 "baseline's (--mode ckpt-restart); ReCoVer's own checkpoints are "
                                 "--checkpoint-dir DIR --checkpoint-every N|Ns")
            from recover.cli.launcher import run_local

            return run_local(args)
        if args.command == "controller":
            return _run_controller(args)
        if args.command == "agent":
            return agentcmd.run(args)
        if args.command == "bench":
            return bench.main(args)
        if args.command == "verify":
            from recover.cli import verify

            return verify.main(args.run_a, args.run_b, args.loss_rtol)
        if args.command == "export":
            return export.run(args)
        if args.command == "plot":
            from recover.cli import plot

            print(f"wrote {plot.plot(args.runs, args.out, args.label, args.x)}")
            return 0
        if args.command == "certs":
            return certs.run(args)
        if args.command == "relay":
            return relaycmd.run(args)
        parse_addresses(args.controller)
        if args.command in ("stop", "drain", "spares"):
            return run_operator(args)
        from recover.cli import inspect

        security = security_from_args(args, args.command)
        if args.command == "summary":
            return inspect.write_summary(args.controller, args.out, args.timeout, security)
        return inspect.main(args, security)
    except UsageError as exc:
        message = str(exc)
        if applied is not None and isinstance(exc, SettingUsageError):
            message = applied.in_file_terms(message, args)
        print(message, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("recover: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
