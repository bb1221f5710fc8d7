"""Work-stealing's decisions (controller/stealing.py) and bookkeeping (stealflow.StealBook),
table-style on the decision and on its reason; no processes, no clock (times are given)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from recover.agent import fencing
from recover.cli.inspect import format_status
from recover.controller.control import job_status
from recover.controller.metrics import ControllerCollector
from recover.controller.records import PersistedJob, Records
from recover.controller.stealflow import StealBook
from recover.controller.stealing import Member, assumed, decide, last_open, split_unstarted
from recover.controller.view import JobView
from recover.proto import pb
from tests.unit.coordinator_harness import Harness, make_job, plan_dict, scenario
from tests.unit.test_takeover import new_leader

NOW = 100.0


def member(replica: int, share: range | tuple[int, ...], done: int, s: float,
           since: float = NOW, **flags: bool) -> Member:
    return Member(replica, tuple(share), done, s, since, **flags)


# Four replicas, 16 microbatches, replica 2 twice as slow (0.1 s vs 0.05 s per microbatch).
EQUAL_IDLE = {0: member(0, range(0, 4), 4, 0.05), 1: member(1, range(4, 8), 3, 0.05, NOW - 0.04),
              2: member(2, range(8, 12), 3, 0.05, NOW - 0.04),
              3: member(3, range(12, 16), 3, 0.05, NOW - 0.04)}
SLOW_TWO = {0: member(0, range(0, 4), 4, 0.05), 1: member(1, range(4, 8), 4, 0.05),
            2: member(2, range(8, 12), 1, 0.1, NOW - 0.09),
            3: member(3, range(12, 16), 4, 0.05)}


@pytest.mark.parametrize(("members", "steals", "close", "reason"), [
    # Everyone else is on their last microbatch: nothing unstarted is left anywhere, so
    # everyone is closed, the busy ones too (they will reduce without asking).
    (EQUAL_IDLE, [], {0, 1, 2, 3}, "replica 3: no member holds a microbatch it has not started"),
    # Replica 2 is on its 2nd of 4 (due in 10 ms, then 2 more): its last two go to two idle
    # members, one each, and the step ends ~65 ms from now instead of 210 ms; the third idle
    # member is left nothing.
    (SLOW_TWO, [(2, {0: (11,), 1: (10,)})], {3},
     "replica 2 (100 ms/microbatch) gives [11] to replica 0, [10] to replica 1: its part of "
     "the step ends in 65 ms instead of 210 ms"),
    # The same, replica 2 already answering a release: the idle ones wait for its answer.
    ({**SLOW_TWO, 2: member(2, range(8, 12), 1, 0.1, NOW - 0.09, giving=True)}, [], set(), ""),
    # Replica 2 is slower than its last report said (its microbatch has taken 0.3 s so far):
    # its pace is at least that, so the three idle members take two each of its six.
    ({**SLOW_TWO, 2: member(2, range(8, 16), 1, 0.1, NOW - 0.3),
      3: member(3, (), 0, 0.05)}, [(2, {0: (12, 15), 1: (11, 14), 3: (10, 13)})], set(), ""),
])
def test_decide(members: dict[int, Member], steals: list[tuple[int, dict[int, tuple[int, ...]]]],
                close: set[int], reason: str) -> None:
    got = decide(members, NOW)
    assert [(s.giver, dict(s.takes)) for s in got.steals] == steals
    assert set(got.close) == close
    if reason:
        assert reason in [*(s.reason for s in got.steals), *got.close.values()]


def test_a_closed_member_neither_gives_nor_takes() -> None:
    members = {**SLOW_TWO, 1: member(1, range(4, 8), 4, 0.05, closed=True)}
    got = decide(members, NOW)
    assert [dict(s.takes) for s in got.steals] == [{0: (11,), 3: (10,)}]
    assert not got.close


def test_nobody_idle_decides_nothing() -> None:
    busy = {r: member(r, range(r * 4, r * 4 + 4), 1, 0.05) for r in range(4)}
    assert decide(busy, NOW).steals == () and not decide(busy, NOW).close


@pytest.mark.parametrize(("giver", "taker_s", "takes"), [
    # 6 unstarted at 0.1 s against one taker at 0.05 s: it takes 4 (both end ~0.3 s on).
    (member(9, range(8), 1, 0.1, NOW - 0.05), 0.05, (4, 5, 6, 7)),
    # A taker as slow as the giver takes half.
    (member(9, range(8), 1, 0.1, NOW - 0.05), 0.1, (5, 6, 7)),
    # A taker 3x slower than the giver only helps with the last one... not even that.
    (member(9, range(4), 2, 0.1, NOW - 0.05), 0.3, ()),
])
def test_split_unstarted(giver: Member, taker_s: float, takes: tuple[int, ...]) -> None:
    got = split_unstarted(giver, [member(0, (), 0, taker_s)], NOW)
    assert got.get(0, ()) == takes


@pytest.mark.parametrize(("flags", "expected"), [
    ({0: {"closed": True}, 1: {"closed": True}, 2: {}}, 2),
    ({0: {"closed": True}, 1: {}, 2: {}}, None),
    ({0: {"closed": True}, 1: {"closed": True}, 2: {"giving": True}}, None),
    ({0: {"closed": True}, 1: {"closed": True}, 2: {"closed": True}}, None),
])
def test_last_open(flags: dict[int, dict[str, bool]], expected: int | None) -> None:
    members = {r: member(r, (r,), 0, 0.05, **f) for r, f in flags.items()}
    assert last_open(members) == expected


def book_for(plan: dict[int, tuple[int, ...]], speeds: dict[int, float]) -> StealBook:
    view = JobView(job=pb.JobConfig(work_stealing=True, global_microbatches=16),
                   generation=3, members=tuple(plan), step=7, plan=plan)
    book = StealBook()
    book.begin(view, NOW - 0.2, speeds)
    return book


def progress(done: list[int], last_s: float, generation: int = 3, step: int = 7) -> pb.Progress:
    return pb.Progress(generation=generation, step=step, done=done, last_s=last_s)


def test_the_book_steals_hands_over_what_was_released_and_closes_the_rest() -> None:
    plan = {0: (0, 1, 2, 3), 1: (4, 5, 6, 7), 2: (8, 9, 10, 11)}
    book = book_for(plan, {0: 0.05, 1: 0.05})  # replica 2 unmeasured: the median
    assert book.progress(0, progress([0, 1, 2, 3], 0.05), NOW)
    assert book.progress(1, progress([4, 5, 6, 7], 0.05), NOW)
    assert book.progress(2, progress([8], 0.15), NOW - 0.01)  # slower than thought
    assert not book.progress(2, progress([8], 0.15, generation=2), NOW)  # an older generation
    assert not book.progress(0, progress([0, 12], 0.05), NOW)  # not its share: ignored
    moves = book.decide(NOW)
    assert [(p.giver, dict(p.takes)) for p in moves.steals] == [(2, {0: (11,), 1: (10,)})]
    assert not moves.close
    (pending,) = moves.steals
    # The giver had started microbatch 10 meanwhile: only 11 is released.
    settled = book.released(2, pb.Released(generation=3, step=7, steal=pending.number,
                                           microbatch_ids=[11]), NOW + 0.01)
    assert settled is not None and dict(settled.takes) == {0: (11,), 1: ()}
    assert book.members[2].share == (8, 9, 10) and book.members[0].share == (0, 1, 2, 3, 11)
    assert book.steals == 1 and book.stolen == 1
    # The same answer again (or another giver's) settles nothing.
    assert book.released(2, pb.Released(generation=3, step=7, steal=pending.number), NOW) is None
    # Replica 2 had started 10, so it is done with 8 and 9: nothing unstarted is left
    # anywhere, and every member is closed, 0 while it computes 11.
    assert book.members[2].done == 2
    moves = book.decide(NOW + 0.01)
    assert moves.steals == () and set(moves.close) == {0, 1, 2}
    assert book.decide(NOW + 0.02) == type(moves)()  # said once


def test_an_empty_answer_means_the_giver_is_on_its_last_microbatch() -> None:
    book = book_for({0: (0,), 1: (1, 2, 3)}, {0: 0.05, 1: 0.1})
    book.progress(0, progress([0], 0.05), NOW)
    (pending,) = book.decide(NOW).steals
    settled = book.released(1, pb.Released(generation=3, step=7, steal=pending.number), NOW)
    assert settled is not None and settled.microbatch_ids == ()
    assert book.empty_answers == 1 and book.members[1].done == 2
    assert book.members[0].share == (0,)
    assert set(book.decide(NOW).close) == {0, 1}  # nothing left: both close


@pytest.mark.parametrize("reports", [
    # (seconds after the step began, done so far, its last microbatch's time, news?)
    pytest.param([(0.05, 1, 0.05, False), (0.10, 2, 0.05, False)], id="on time: no news"),
    pytest.param([(0.10, 1, 0.10, True)],
                 id="slower: its silence had said on schedule (2 done by then)"),
    pytest.param([(0.05, 1, 0.05, False), (0.10, 2, 0.05, False), (0.15, 3, 0.05, True)],
                 id="on its last microbatch: a taker"),
    pytest.param([(0.05, 1, 0.05, False), (0.10, 2, 0.05, False), (0.15, 3, 0.05, True),
                  (0.20, 4, 0.05, True)], id="idle: one to close"),
    pytest.param([(0.10, 1, 0.10, True), (0.15, 2, 0.05, True)],
                 id="2x faster than its last: ends its share well before predicted"),
    pytest.param([(0.05, 1, 0.20, True)],
                 id="says its microbatch took 4x the time seen: its share ends far later"),
])
def test_only_news_calls_for_a_decision(reports: list[tuple[float, int, float, bool]]) -> None:
    # Deciding at every report cost O(members) a report; a report that only confirms the
    # prediction (a quiet member assumed on schedule since it was last heard of) cannot
    # change a decision. Members send only news (common/stealnews.py); the book checks.
    book = book_for({0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}, {0: 0.05, 1: 0.05})
    began = NOW - 0.2
    for after, done, last_s, news in reports:
        assert book.progress(0, progress(list(range(done)), last_s), began + after) is news
    assert book.members[0].done == reports[-1][1]


def test_a_plan_without_work_stealing_keeps_no_book() -> None:
    view = JobView(job=pb.JobConfig(), generation=1, members=(0, 1), plan={0: (0,), 1: (1,)})
    book = StealBook()
    book.begin(view, NOW, {})
    assert not book.progress(0, progress([0], 0.05, generation=1, step=0), NOW)
    assert book.decide(NOW).steals == ()


def test_a_new_leader_resumes_the_plan_as_the_last_steal_left_it() -> None:
    view = pb.GenerationView(generation=3, members=[0, 1], plan=pb.Plan(
        step=7, generation=3, assignments=[pb.Assignment(replica=0, microbatch_ids=[0, 1]),
                                           pb.Assignment(replica=1, microbatch_ids=[2, 3])]))
    stolen = pb.Plan(step=7, generation=3, version=2, assignments=[
        pb.Assignment(replica=0, microbatch_ids=[0, 1, 3]),
        pb.Assignment(replica=1, microbatch_ids=[2])])
    persisted = PersistedJob(view=view, plan=stolen)
    held, source = persisted.plan_held_for(7)
    assert held is stolen and "after 2 steals" in source
    # A stored plan of an older generation, or of another step, is not the one held.
    older = PersistedJob(view=view, plan=pb.Plan(step=7, generation=2, version=5))
    assert older.plan_held_for(7)[0] is view.plan


@pytest.mark.parametrize(("kind", "generation", "accept"), [
    ("share", 4, True), ("share", 3, False), ("release", 4, True), ("release", 5, False),
])
def test_agents_fence_steals_like_commits(kind: str, generation: int, accept: bool) -> None:
    verdict = fencing.judge(kind, 1, generation, 1, 4)
    assert verdict.accept is accept
    assert (kind in verdict.reason) if not accept else True


# ------------------------------------------------------------ the coordinator, in-process


def stealing_job(steps: int = 4) -> pb.JobConfig:
    job = make_job(replicas=3, steps=steps, m=6)
    job.work_stealing = True
    return job


@scenario
async def test_the_coordinator_steals_stores_the_plan_and_commits_what_moved() -> None:
    h = Harness(stealing_job())
    await h.start()
    c = h.coord
    assert c.plan == {0: (0, 1), 1: (2, 3), 2: (4, 5)}
    views = h.messages("generation")
    assert views and all(v.plan.open for _, v in views)  # members report progress
    h.clock.now += 0.05
    await c.progress(0, pb.Progress(generation=1, step=0, done=[0], last_s=0.05))
    await c.progress(1, pb.Progress(generation=1, step=0, done=[2], last_s=0.05))
    h.clock.now += 0.05
    await c.progress(0, pb.Progress(generation=1, step=0, done=[0, 1], last_s=0.05))
    await h.settle()
    (agent, release), = h.messages("release")  # replica 2 has not reported at all
    assert agent == "a2" and release.replica == 2 and list(release.microbatch_ids) == [5]
    await c.released(2, pb.Released(generation=1, step=0, steal=release.steal,
                                     microbatch_ids=[5]))
    assert c.plan == {0: (0, 1, 5), 1: (2, 3), 2: (4,)}
    await h.settle()
    stored = (await Records(h.store, h.job.job_id).load()).plan
    assert stored is not None and stored.version == 1 and plan_dict(stored)[0] == (0, 1, 5)
    (agent, share), = [(a, s) for a, s in h.messages("share") if s.open]
    assert agent == "a0" and list(share.microbatch_ids) == [0, 1, 5]
    assert [e.message for e in h.events("steal")] == [
        "replica 2 (100 ms/microbatch) gives [5] to replica 0: its part of the step ends "
        "in 55 ms instead of 100 ms"]

    # A new leader now resumes the plan as the steal left it, not the generation's.
    h2 = await new_leader(h)
    assert h2.coord.plan == {0: (0, 1, 5), 1: (2, 3), 2: (4,)}

    # The old leader carries on: every member finishes and is closed, then reduces.
    await c.progress(1, pb.Progress(generation=1, step=0, done=[2, 3], last_s=0.05))
    await c.progress(2, pb.Progress(generation=1, step=0, done=[4], last_s=0.2))
    await c.progress(0, pb.Progress(generation=1, step=0, done=[0, 1, 5], last_s=0.05))
    await h.settle()
    closed = {s.replica for _, s in h.messages("share") if not s.open}
    assert closed == {0, 1, 2}
    await h.reduce()
    commit = h.messages("commit")[0][1]  # one per agent
    assert commit.record.stolen == 1 and commit.next_plan.open
    assert commit.next_plan.version == 0
    metrics = {m.name: m for m in ControllerCollector(c).collect()}
    assert metrics["recover_steals"].samples[0].value == 1
    assert metrics["recover_microbatches_stolen"].samples[0].value == 1
    assert "stealing    1 steals moved 1 microbatches" in format_status(job_status(c))


@scenario
async def test_reports_read_in_one_pass_of_the_loop_are_decided_on_once() -> None:
    # Near a step's end every member reports within one microbatch's time, and a decision
    # costs O(members): the coordinator folds what it read in one pass into one decision.
    h = Harness(stealing_job())
    await h.start()
    c = h.coord
    decided = []
    moves = c.inflight.moves
    c.inflight.moves = lambda: decided.append(c.view.step) or moves()
    h.clock.now += 0.1
    for replica, done in ((0, [0, 1]), (1, [2, 3])):  # both idle: news
        await c.progress(replica, pb.Progress(generation=1, step=0, done=done, last_s=0.05))
    assert decided == [] and not h.messages("release")
    await h.settle()
    assert decided == [0]
    (_, release), = h.messages("release")
    assert release.replica == 2 and list(release.microbatch_ids) == [5]


@scenario
async def test_a_loss_during_a_steal_replans_from_the_plan_in_force() -> None:
    h = Harness(stealing_job())
    await h.start()
    c = h.coord
    h.clock.now += 0.1
    await c.progress(0, pb.Progress(generation=1, step=0, done=[0, 1], last_s=0.05))
    await h.settle()
    (_, release), = h.messages("release")
    # The giver dies before answering: its share, the microbatch asked for included,
    # is reassigned; the late answer of the old generation moves nothing.
    await c.worker_exited(pb.WorkerExited(replica=2, signal=9))
    assert c.generation == 2 and sorted(mb for ids in c.plan.values() for mb in ids) == \
        list(range(6))
    plan = dict(c.plan)
    await c.released(2, pb.Released(generation=1, step=0, steal=release.steal,
                                     microbatch_ids=[5]))
    assert c.plan == plan and c.stale_reports == 1
    assert not [s for _, s in h.messages("share") if s.open]


def test_members_of_about_the_same_speed_steal_nothing() -> None:
    # Replica 1 is 5 % slower than the idle replica 0 and has one microbatch it has not
    # started: moving it would end the step a few ms sooner at best, less than a quarter
    # microbatch, so nothing moves and the idle one is closed (then replica 1 is the last
    # open member: the book closes it too, see last_open).
    members = {0: member(0, range(0, 4), 4, 0.050),
               1: member(1, range(4, 8), 2, 0.0525, NOW - 0.01)}
    got = decide(members, NOW)
    assert got.steals == () and set(got.close) == {0}


def test_a_steal_is_decided_before_the_takers_are_idle() -> None:
    # Replicas 0 and 1 are on their last microbatch (done in 20 ms); replica 2, twice as
    # slow, is on its second of four. Deciding now, not once 0 and 1 are idle, gets the
    # Release to replica 2 before it starts its third: both of its last two can move.
    members = {0: member(0, range(0, 4), 3, 0.05, NOW - 0.03),
               1: member(1, range(4, 8), 3, 0.05, NOW - 0.03),
               2: member(2, range(8, 12), 1, 0.1, NOW - 0.05)}
    got = decide(members, NOW)
    assert [(s.giver, dict(s.takes)) for s in got.steals] == [(2, {0: (11,), 1: (10,)})]
    assert not got.close  # nobody is idle: nobody is closed yet


@pytest.mark.parametrize("done, since_ago, pace, assumed_done, predicted_finish_in", [
    # A quiet member of a 6-microbatch share, last heard of `since_ago` s before NOW with
    # `done` done, at `pace` s a microbatch: what its silence says now.
    (0, 0.00, 0.05, 0, 0.30),    # just heard of: nothing assumed
    (0, 0.12, 0.05, 2, 0.18),    # on schedule: two done, in its third, 6 x 0.05 from then
    (0, 0.30, 0.05, 4, 0.10),    # never past the start of its last (it would report that):
    (0, 0.40, 0.05, 4, 0.20),    # silent after it, it is late: its current one slows it
    (3, 0.08, 0.05, 1, 0.07),    # 3 left then: one more assumed, its last starts at +0.02
    (5, 0.30, 0.05, 0, 0.00),    # on its last (reported): nothing assumed, ends any moment
    (0, 0.12, 0.00, 0, 0.60),    # no pace known yet: nothing assumed, its time so far is one
])
def test_a_quiet_member_is_assumed_on_schedule(done: int, since_ago: float, pace: float,
                                               assumed_done: int,
                                               predicted_finish_in: float) -> None:
    quiet = member(0, range(6), done, pace, NOW - since_ago, quiet=True)
    said = assumed(quiet, NOW)
    assert said.done == done + assumed_done and not said.quiet
    assert said.since == pytest.approx(NOW - since_ago + assumed_done * pace)
    assert quiet.finish(NOW) == pytest.approx(said.finish(NOW))
    assert quiet.finish(NOW) - NOW == pytest.approx(predicted_finish_in)
    assert replace(quiet, quiet=False).finish(NOW) >= quiet.finish(NOW)  # silence: not late


# ---------------------------------------------------------------- the fast decide vs the first one

def _random_members(rng, count: int, per: int) -> dict[int, Member]:
    members, first = {}, 0
    for replica in range(count):
        share = tuple(range(first, first + rng.randint(0, per)))
        first += len(share)
        flags = rng.choice([{}, {}, {}, {"closed": True}, {"giving": True}, {"taking": True}])
        # Speeds from a few values, so that ties between takers happen and their order counts.
        members[replica] = member(replica, share, rng.randint(0, len(share)),
                                  rng.choice([0.0, 0.02, 0.05, 0.05, 0.1, rng.uniform(0.01, 0.3)]),
                                  NOW - rng.choice([0.0, 0.01, 0.05, rng.uniform(0, 0.4)]), **flags)
    return members


@pytest.mark.parametrize("seed", range(300))
def test_decide_agrees_with_the_quadratic_first_version(seed: int) -> None:
    # The first version (tests/unit/stealing_reference.py) is the specification: the same
    # steals, takes, reasons and closes, on small and large books, ties and flags included.
    # Quiet members (reporting only news) are to decide as the first version decides on
    # what their silence says of them (`assumed`: on schedule since last heard of).
    import random

    from tests.unit.stealing_reference import reference_decide, reference_split_unstarted

    rng = random.Random(seed)
    members = _random_members(rng, rng.choice([2, 3, 5, 8, 16, 64, 200]), rng.choice([2, 4, 9]))
    latency = rng.choice([0.0, 0.005, 0.05])
    quiet = {r: replace(m, quiet=rng.random() < 0.7) for r, m in members.items()}
    for book in (members, quiet):
        said = {r: assumed(m, NOW) for r, m in book.items()}
        assert decide(book, NOW, latency) == reference_decide(said, NOW, latency)
        giver, *takers = book.values()
        assert split_unstarted(giver, takers, NOW, latency) == \
            reference_split_unstarted(said[giver.replica], [said[t.replica] for t in takers],
                                      NOW, latency)
