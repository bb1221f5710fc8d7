"""`recover status` and `recover events`: read a running controller."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from recover.client.connect import ControllerUnreachable, connect_leader
from recover.common.security import Security
from recover.proto import pb, rpc


def to_json(message: Message) -> str:
    """snake_case JSON with numbers as numbers (protobuf's JSON turns int64 into strings)."""
    fields = {f.name: f for f in message.DESCRIPTOR.fields}

    def fix(value: object, field_name: str) -> object:
        field = fields.get(field_name)
        if field is not None and field.cpp_type in (field.CPPTYPE_INT64, field.CPPTYPE_UINT64):
            return [int(v) for v in value] if isinstance(value, list) else int(value)  # type: ignore[arg-type]
        return value

    raw = MessageToDict(message, preserving_proto_field_name=True,
                        always_print_fields_with_no_presence=True)
    return json.dumps({k: fix(v, k) for k, v in raw.items()})


class EventCursor:
    """Where a reader is in the job's events, across leaders.

    A new leader numbers its events on from those its predecessor had stored, which may be
    fewer than it had sent (they are stored behind the critical path): numbers already seen
    can come back on new events. So after a lost connection the events are read from the
    start again, and one already seen (its number and its time no later than the last seen)
    is skipped.
    """

    def __init__(self) -> None:
        self.after = 0
        self.last_at = 0.0
        self.reread = False

    def request(self) -> pb.EventsRequest:
        return pb.EventsRequest(after_seq=0 if self.reread else self.after)

    def fresh(self, events: list[pb.Event]) -> list[pb.Event]:
        """The events of one answer not seen before, in order."""
        new = [e for e in events if not (e.seq <= self.after and e.at <= self.last_at)]
        if events or self.reread:  # a leader with none yet numbers its first 1
            self.after = events[-1].seq if events else 0
        self.reread = False
        if new:
            self.last_at = max(self.last_at, max(e.at for e in new))
        return new


def format_load(load: Iterable[pb.ReplicaLoad]) -> str:
    """replica:quota@measured time per microbatch+lead, e.g. `0:1@100ms+20ms 2:2@200ms+2ms`."""
    return " ".join(f"{entry.replica}:{entry.microbatches}" + (
        f"@{entry.microbatch_s * 1000:.0f}ms" if entry.microbatch_s else "") + (
        f"+{entry.lead_s * 1000:.0f}ms" if entry.lead_s else "") for entry in load)


def format_status(status: pb.JobStatus) -> str:
    load = format_load(status.load)
    lines = [
        *([f"leader      {status.leader} (term {status.term})"] if status.leader else []),
        f"job         {status.job_id}",
        f"state       {status.state}" + (f" ({status.reason})" if status.reason else ""),
        f"step        {status.steps_committed}/{status.steps_total}",
        f"generation  {status.generation}",
        f"replicas    {len(status.live_replicas)} live {list(status.live_replicas)} "
        f"on {status.agents} agents" + (f", joining {list(status.joining)}" if status.joining
                                        else ""),
        *([f"relays      {status.relays}, carrying {status.agents_via_relays} agents' sessions"]
          if status.relays else []),
        f"plan        {load or '-'} (replica:microbatches@measured time per microbatch+lead after a commit)",
        *([f"stealing    {status.steals} steals moved {status.microbatches_stolen} "
           "microbatches"] if status.work_stealing else []),
        f"recoveries  {status.recoveries}",
        f"loss        {status.last_loss:.4f}",
        f"tokens      {status.tokens}",
        f"elapsed     {status.elapsed_s:.1f}s",
    ]
    return "\n".join(lines)


def format_event(event: pb.Event) -> str:
    where = " ".join(
        f"{name}={value}" for name, value in
        (("step", event.step), ("gen", event.generation), ("replica", event.replica)) if value >= 0)
    stamp = time.strftime("%H:%M:%S", time.localtime(event.at)) + f".{int(event.at % 1 * 1000):03d}"
    return f"{stamp} #{event.seq:<4} {event.kind:<16} {where:<28} {event.message}"


def write_summary(addresses: str, out: str, timeout_s: float,
                  security: Security | None = None) -> int:
    """`recover summary`: fetch the run report from the leader, write OUT/summary.json."""
    from recover.controller.summary import build_summary, format_summary
    from recover.controller.summary import write_summary as write

    connected = connect_or_say("summary", addresses, timeout_s, security)
    if connected is None:
        return 1
    channel, stub = connected
    try:
        report = stub.Report(pb.ReportRequest(), timeout=timeout_s)
    except grpc.RpcError as exc:
        print(f"recover summary: controller at {addresses} failed: {exc.code().name}: "
              f"{exc.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    finally:
        channel.close()
    end = report.finished_at or time.time()
    summary = build_summary(report, end - report.started_at if report.started_at else 0.0)
    try:
        path = write(summary, out)
    except OSError as exc:
        blocked = isinstance(exc, FileExistsError | NotADirectoryError)
        why = f"{out} (or a folder above it) is a file" if blocked else exc.strerror
        print(f"recover summary: cannot write into {out}: {why}", file=sys.stderr)
        return 1
    print(format_summary(summary))
    print(f"summary: {path}" + ("" if report.finished_at else " (the job is still running)"))
    return 0


def connect_or_say(command: str, addresses: str, timeout_s: float, security: Security | None
                   ) -> tuple[grpc.Channel, rpc.ControlStub] | None:
    """The leader's channel, or None after saying on stderr why there is none."""
    try:
        return connect_leader(addresses, timeout_s, security)
    except ControllerUnreachable as exc:
        print(f"recover {command}: {exc}", file=sys.stderr)
        return None


def main(args: argparse.Namespace, security: Security | None = None) -> int:
    connected = connect_or_say(args.command, args.controller, args.timeout, security)
    if connected is None:
        return 1
    channel, stub = connected
    try:
        if args.command == "status":
            status = stub.Status(pb.StatusRequest(), timeout=5)
            print(to_json(status) if args.json else format_status(status))
            return 0
        cursor = EventCursor()
        while True:
            try:
                answer = stub.Events(cursor.request(), timeout=5).events
            except grpc.RpcError:
                if not args.follow:
                    raise
                # Following: the leader may have changed (or be changing): find it again.
                channel.close()
                connected = connect_or_say(args.command, args.controller, args.timeout, security)
                if connected is None:
                    return 1
                channel, stub = connected
                cursor.reread = True
                continue
            for event in cursor.fresh(answer):
                print(to_json(event) if args.json else format_event(event), flush=True)
            if not args.follow:
                return 0
            time.sleep(0.5)
    except grpc.RpcError as exc:
        print(f"recover {args.command}: controller at {args.controller} failed: "
              f"{exc.code().name}: {exc.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    finally:
        channel.close()
