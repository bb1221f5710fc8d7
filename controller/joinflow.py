"""Joins as transitions: start transfers, follow them, retry, admit.

The decisions (which donor, when a joiner enters, whether to retry) are pure
functions in joins.py; these transitions record the commands and keep each join
in the view (`JobView.joins`, the joiner's `ReplicaState` moving with it). A joiner
enters the generation that follows a commit: the commit goes out without the next
plan, and the new generation's plan covers the joiners too (commits.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Collection, Sequence

from recover.controller import effects
from recover.controller.joins import (
    RETRY_DELAY_S,
    Join,
    JoinPhase,
    after_failure,
    check_snapshot,
    choose_donor,
    entry,
)
from recover.controller.view import Draft, ReplicaState
from recover.proto import pb


def add(d: Draft, replica: int) -> None:
    """A replica that became ready while the job runs (its transfer endpoint in the view):
    bring it in."""
    _start(d, Join(replica))


def _start(d: Draft, join: Join) -> None:
    v = d.v
    donating = Counter(j.donor for j in v.joins.values()
                       if j.phase is not JoinPhase.WAITING_DONOR and j.joiner != join.joiner)
    load = {m: len(v.plan.get(m, ())) for m in v.members}
    choice = choose_donor(v.members, load, donating, join.failed_donors)
    if choice.donor is None:
        d.put_join(dataclasses.replace(join, phase=JoinPhase.WAITING_DONOR))
        return
    join = dataclasses.replace(join, phase=JoinPhase.TRANSFERRING, donor=choice.donor,
                               token=d.facts.token(), attempts=join.attempts + 1,
                               started_at=d.now)
    d.put_join(join)
    joiner = v.replicas[join.joiner]
    d.send_replica(choice.donor, pb.ControllerMessage(donate=pb.Donate(
        donor=choice.donor, joiner=join.joiner, address=joiner.transfer_address,
        token=join.token, tls_sha256=joiner.transfer_tls_sha256)))
    d.send_replica(join.joiner, pb.ControllerMessage(join=pb.Join(
        joiner=join.joiner, donor=choice.donor, token=join.token, attempt=join.attempts)))
    d.emit("join-started", f"attempt {join.attempts}: {choice.reason}", step=v.step,
           replica=join.joiner)


def progress(d: Draft, replica: int, msg: pb.JoinProgress,
             committed: Collection[str] = ()) -> None:
    """`committed`: the members' digests of the step before `msg.step`, which the state a
    joiner loaded from its snapshot must match."""
    join = d.v.joins.get(replica)
    if join is None or msg.attempt != join.attempts:
        d.do(effects.Stale())  # a report of an attempt that was already replaced
        return
    check = check_snapshot(msg.param_sha256, committed, msg.step, join.donor)
    if not check.trusted:
        d.emit("snapshot-refused", check.reason, step=msg.step, replica=replica,
               level=logging.WARNING)
        attempt_failed(d, replica, pb.JoinFailed(donor=join.donor, reason=check.reason,
                                                 attempt=msg.attempt, step=-1))
        return
    if join.snapshot_bytes == 0 and msg.snapshot_bytes:
        join = dataclasses.replace(join, snapshot_bytes=msg.snapshot_bytes,
                                   snapshot_s=msg.snapshot_s)
        d.do(effects.Transferred(msg.snapshot_bytes, msg.snapshot_s))
        rate = msg.snapshot_bytes / msg.snapshot_s / 1e6 if msg.snapshot_s > 0 else 0.0
        over = "TLS" if d.v.replicas[replica].transfer_tls_sha256 else "TCP"
        d.emit("state-transfer", f"{msg.snapshot_bytes} bytes from replica {join.donor} in "
               f"{msg.snapshot_s:.3f}s ({rate:.0f} MB/s) over {over}, state before step "
               f"{msg.step}", step=d.v.step, replica=replica)
    join = dataclasses.replace(join, step=msg.step)
    if join.step >= d.v.step:
        join = dataclasses.replace(join, phase=JoinPhase.CAUGHT_UP)
    d.put_join(join)


def attempt_failed(d: Draft, replica: int, msg: pb.JoinFailed) -> None:
    """A transfer to a joiner that is not a member yet broke: try another donor, or give up."""
    join = d.v.joins.get(replica)
    if join is None or msg.attempt != join.attempts:
        d.do(effects.Stale())  # a report of an attempt that was already replaced
        return
    join = dataclasses.replace(join, step=max(join.step, msg.step))  # what it holds is good
    retry = after_failure(join, msg.reason)
    if not retry.retry:
        d.drop_join(replica)
        d.change_replica(replica, state=ReplicaState.READY)  # stopped: its exit is recorded
        d.set(abandoned=d.v.abandoned + 1)
        d.emit("join-abandoned", retry.reason, replica=replica, level=logging.WARNING)
        d.send_replica(replica, pb.ControllerMessage(
            stop_replica=pb.StopReplica(replica=replica, reason=retry.reason)))
        return
    d.emit("join-failed", retry.reason, replica=replica, level=logging.WARNING)
    d.put_join(dataclasses.replace(
        join, failed_donors=(*join.failed_donors, join.donor), phase=JoinPhase.WAITING_DONOR,
        retry_at=d.now + RETRY_DELAY_S))


def rejoin(d: Draft, replica: int, msg: pb.JoinFailed) -> None:
    """A member taken out of the step it was admitted to (its donor died a step short,
    losses.py) joins again: its last attempt failed, with what it holds still good."""
    d.put_join(Join(replica, phase=JoinPhase.TRANSFERRING, donor=msg.donor,
                    attempts=msg.attempt, step=msg.step))
    attempt_failed(d, replica, msg)


def retry_waiting(d: Draft) -> None:
    """Joins that found no donor, or whose transfer failed a moment ago: try again."""
    for join in list(d.v.joins.values()):
        if join.phase is JoinPhase.WAITING_DONOR and join.retry_at <= d.now:
            _start(d, join)


def entering(d: Draft, enters_at: int, *, final: bool = False,
             replacing: Sequence[int] | None = None) -> list[int]:
    """The joiners that become members from step `enters_at` on: after the commit of
    the step before it, or in the middle of that step in place of lost members, next to
    the members `replacing` names (the survivors): only those holding its state."""
    chosen: list[int] = []
    members = len(d.v.members) if replacing is None else len(replacing)
    for join in sorted(d.v.joins.values(), key=lambda j: j.joiner):
        verdict = entry(join, enters_at, in_flight=1 if replacing is None else 0,
                        members=members + len(chosen), target=d.v.job.replicas, final=final)
        if verdict.enter:
            chosen.append(join.joiner)
            d.drop_join(join.joiner)
            d.set(joined=d.v.joined + 1)
            d.emit("spare-promoted" if join.spare else "replica-joined", verdict.reason,
                   step=enters_at, replica=join.joiner)
        elif verdict.spare and not join.spare:
            d.put_join(dataclasses.replace(join, spare=True))
    return chosen
