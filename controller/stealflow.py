"""Work-stealing's protocol: the step in flight's progress, Releases and hand-overs.

The decisions are stealing.py's; this module keeps what the controller heard of each
member in the step in flight (`StealBook`, reset by every generation and commit) and the
transitions that carry the decisions out. In order, for one steal:

1. a member's Progress shows it idle or on its last microbatch: `stealing.decide` picks
   a giver and splits its last unstarted microbatches among the takers;
2. the giver is sent a Release of them (`steer`), and is asked nothing else until it
   answers;
3. the giver, between two microbatches, drops those it has not started and answers
   Released with exactly them (then reports its progress: it is between two microbatches);
4. the plan moves them to the takers and is stored (a new leader resumes from it), and
   only then is each taker sent its grown share (`hand_over`).

Every message names its generation and step, and the book is reset when either changes:
a Release or Released of an older generation is dropped by the agent or ignored here, and
the generation that replaced it was planned from the stored plan, which holds a microbatch
either with the giver or (once released and stored) with the taker, never both. A kill of
giver or taker during a steal is then an ordinary failure.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import replace

from recover.common.stealnews import NEWS_MARGIN
from recover.controller import effects
from recover.controller.jobstate import plan_message
from recover.controller.policy import PlanDecision
from recover.controller.stealing import (
    DEFAULT_LATENCY_S,
    Decisions,
    Member,
    Steal,
    after_release,
    decide,
    last_open,
)
from recover.controller.view import Draft, JobView
from recover.proto import pb


class StealBook:
    """What the controller heard of the step in flight's members, for work-stealing."""

    def __init__(self, latency_s: float = DEFAULT_LATENCY_S) -> None:
        self.latency_s = latency_s
        self.members: dict[int, Member] = {}
        self.pending: dict[int, Steal] = {}
        """Steals asked for and not yet answered, by number."""
        self._key: tuple[int, int] | None = None
        """(generation, step) the book is about; None: no open plan in flight."""
        self._next_steal = 1
        self.steals = 0
        """Steals that moved at least one microbatch, over the controller's life."""
        self.stolen = 0
        """Microbatches moved by them."""
        self.empty_answers = 0
        """Releases answered with nothing (the giver had started them all)."""

    def begin(self, view: JobView | None, now: float, speeds: Mapping[int, float]) -> None:
        """A generation or a commit put a new plan in force (None: a commit without one,
        a new generation follows): start over."""
        self.pending.clear()
        self.members.clear()
        if view is None or not view.job.work_stealing or not view.plan:
            self._key = None
            return
        self._key = (view.generation, view.step)
        known = [speeds[m] for m in view.members if m in speeds]
        default = statistics.median(known) if known else 0.0
        for m in view.members:
            self.members[m] = Member(m, tuple(view.plan.get(m, ())), 0,
                                     speeds.get(m, default), now, quiet=True)

    def current(self, generation: int, step: int) -> bool:
        return self._key == (generation, step)

    def progress(self, replica: int, msg: pb.Progress, now: float) -> bool:
        """A member's progress; True when it is news the decisions may turn on: the member
        is now on its last microbatch or idle (a taker, or one to close), or it ends its
        share at least NEWS_MARGIN of a microbatch sooner or later than predicted. Members
        send only such reports (common/stealnews.py); another (its speed back on the
        prediction) confirms what the last decisions were made on, and deciding again at
        every report cost the controller O(members) per report, O(members²) per step
        (bench/scripts/stealing_step.py)."""
        member = self.members.get(replica)
        if member is None or not self.current(msg.generation, msg.step):
            return False
        if not set(msg.done) <= set(member.share):
            return False  # a share changed since it was sent: the next report is right
        speed = msg.last_s if msg.last_s > 0 else member.seconds_per_mb
        reported = replace(member, done=len(msg.done), seconds_per_mb=speed, since=now)
        self.members[replica] = reported
        if reported.idle and not member.idle or member.unstarted and not reported.unstarted:
            return True
        return abs(reported.finish(now) - member.finish(now)) > NEWS_MARGIN * reported.pace(now)

    def released(self, replica: int, msg: pb.Released, now: float) -> Steal | None:
        """The giver's answer: the steal it settles, each taker's part cut to what was
        released (None: not one of this book's, e.g. of an older generation)."""
        pending = self.pending.get(msg.steal)
        if (pending is None or pending.giver != replica
                or not self.current(msg.generation, msg.step)):
            return None
        del self.pending[msg.steal]
        released = set(msg.microbatch_ids)
        takes = {t: tuple(mb for mb in ids if mb in released) for t, ids in pending.takes.items()}
        moved = [mb for ids in takes.values() for mb in ids]
        giver = self.members[pending.giver]
        share = after_release(giver.share, moved)
        # Those asked for but kept had been started, and a worker computes its share in
        # order: every one before them is done, which its progress may not have shown yet.
        kept = [share.index(mb) for mb in pending.microbatch_ids if mb in share]
        done = max([giver.done, *kept])
        self.members[pending.giver] = replace(giver, share=share, done=done, giving=False)
        if moved:
            self.steals += 1
            self.stolen += len(moved)
        else:
            self.empty_answers += 1
        for taker, ids in takes.items():
            member = self.members[taker]
            self.members[taker] = replace(member, taking=False, share=member.share + ids,
                                          since=now if member.idle and ids else member.since)
        return replace(pending, takes=takes)

    def decide(self, now: float) -> Decisions:
        """The Releases (steals, numbered) and closes the book's state calls for now."""
        if self._key is None:
            return Decisions()
        decisions = decide(self.members, now, self.latency_s)
        numbered = []
        for steal in decisions.steals:
            pending = replace(steal, number=self._next_steal)
            self._next_steal += 1
            self.pending[pending.number] = pending
            self.members[steal.giver] = replace(self.members[steal.giver], giving=True)
            for taker in steal.takes:
                self.members[taker] = replace(self.members[taker], taking=True)
            numbered.append(pending)
        close = dict(decisions.close)
        for replica in close:
            self.members[replica] = replace(self.members[replica], closed=True)
        last = last_open(self.members)
        if last is not None:
            self.members[last] = replace(self.members[last], closed=True)
            close[last] = f"replica {last} is the last open member: nobody is left to take from it"
        return Decisions(tuple(numbered), close)


# ------------------------------------------------------------------ transitions


def steer(d: Draft, moves: Decisions, shares: Mapping[int, tuple[int, ...]]) -> None:
    """Send the Releases and closes `StealBook.decide` asked for."""
    v = d.v
    for p in moves.steals:
        d.send_replica(p.giver, pb.ControllerMessage(release=pb.Release(
            generation=v.generation, step=v.step, replica=p.giver, steal=p.number,
            microbatch_ids=p.microbatch_ids)))
    for replica, reason in moves.close.items():
        d.send_replica(replica, pb.ControllerMessage(share=pb.ShareUpdate(
            generation=v.generation, step=v.step, replica=replica,
            microbatch_ids=shares[replica], open=False, reason=reason)))


def hand_over(d: Draft, settled: Steal) -> None:
    """A giver released `settled.microbatch_ids`: they are the takers', in the stored plan
    before any taker hears of them."""
    v = d.v
    plan = dict(v.plan)
    plan[settled.giver] = after_release(plan[settled.giver], settled.microbatch_ids)
    for taker, ids in settled.takes.items():
        plan[taker] = plan[taker] + ids
    version = v.plan_version + 1
    d.set(plan=plan, plan_version=version, stolen=v.stolen + len(settled.microbatch_ids))
    d.do(effects.SavePlan(plan_message(v.step, v.generation, v.scale_epoch,
                                       PlanDecision(plan, settled.reason), open_shares=True,
                                       version=version)))
    for taker, ids in settled.takes.items():
        if ids:
            d.send_replica(taker, pb.ControllerMessage(share=pb.ShareUpdate(
                generation=v.generation, step=v.step, replica=taker,
                microbatch_ids=plan[taker], open=True, reason=settled.reason)))
    d.emit("steal", settled.reason, step=v.step, generation=v.generation,
           replica=settled.giver)
