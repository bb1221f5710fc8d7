"""What an agent keeps of its workers' reports, and its own requests, for a new session.

A leader may die before persisting what a worker reported (a report sent while no leader
listened is gone), so on rejoining a new one the agent replays each replica's last
`applied` report (its parameter digest), or its `ready` report when the job had not
started. The last applied step per replica also decides which commits a worker still needs
(`fencing.wants_commit`). A request for a slot's replica not answered yet is asked again on
a new session (to a new leader, or the same one after a relay died): the question or its
answer may have been lost with the old one, and the leader answers a repeat alike.
"""

from __future__ import annotations

from recover.proto import pb


class ReportReplays:
    def __init__(self) -> None:
        self.applied: dict[int, pb.WorkerReport] = {}
        self.applied_step: dict[int, int] = {}
        """Replica -> the last step it applied (-1: none yet)."""
        self.ready: dict[int, pb.WorkerReport] = {}
        self.asked: dict[int, str] = {}
        """Slot -> why its replica was asked for, until an answer (any) came."""

    def note(self, report: pb.WorkerReport) -> None:
        """Keep what a new leader would need of this report."""
        kind = report.WhichOneof("kind")
        if kind == "applied":
            self.applied[report.replica] = report
            self.applied_step[report.replica] = report.applied.step
        elif kind == "reduced" and report.reduced.applied:  # folded in: the same for fencing
            last = report.reduced.applied[-1]
            self.applied[report.replica] = pb.WorkerReport(replica=report.replica, applied=last)
            self.applied_step[report.replica] = last.step
        elif kind == "ready":
            self.ready[report.replica] = report

    def for_new_leader(self, started: bool) -> list[pb.WorkerReport]:
        """The reports to replay, in replica order: the last digests, or readiness when the
        job had not started."""
        replays = self.applied if started else self.ready
        return [replays[replica] for replica in sorted(replays)]

    def requests(self) -> list[pb.AgentMessage]:
        """The requests for a slot's replica still without an answer, to ask again."""
        return [pb.AgentMessage(replica_request=pb.ReplicaRequest(slot=slot, reason=reason))
                for slot, reason in sorted(self.asked.items())]
