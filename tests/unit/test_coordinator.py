"""The coordinator driven directly: MemoryStore, a recording `send`, a fake clock.

No network, no processes: every test builds a Coordinator inside asyncio.run
and feeds it the calls the gRPC layer would make.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from recover.controller.coordinator import (
    Coordinator,
    JobState,
    RegistrationRefused,
)
from recover.controller.jobstate import sample_digest
from recover.controller.store import MemoryStore
from recover.proto import pb

JOB_ID = "job-unit"
STEPS_PREFIX = f"/recover/{JOB_ID}/steps/"
RENDEZVOUS = "127.0.0.1:29999"


def make_job(replicas: int = 2, steps: int = 2, m: int = 4) -> pb.JobConfig:
    return pb.JobConfig(
        job_id=JOB_ID, replicas=replicas, steps=steps, global_microbatches=m,
        microbatch_size=2, seed=0, reduce="fast", learning_rate=1e-3,
        model=pb.ModelConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=1, n_embd=8))


def run_now(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never suspends (MemoryStore's reads) from sync code."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise AssertionError("store read suspended; cannot read it synchronously")


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Harness:
    def __init__(self, job: pb.JobConfig, agent_timeout_s: float = 3.0) -> None:
        self.job = job
        self.store = MemoryStore()
        self.clock = FakeClock()
        self.sent: list[tuple[str, pb.ControllerMessage]] = []
        self.on_send: list[Callable[[str, pb.ControllerMessage], None]] = []
        self.coord = Coordinator(job, self.store, self.send, RENDEZVOUS,
                                 agent_timeout_s=agent_timeout_s, clock=self.clock)

    def send(self, agent_id: str, message: pb.ControllerMessage) -> None:
        self.sent.append((agent_id, message))
        for hook in self.on_send:
            hook(agent_id, message)

    def messages(self, kind: str) -> list[tuple[str, Any]]:
        return [(a, getattr(m, kind)) for a, m in self.sent if m.WhichOneof("kind") == kind]

    def events(self, kind: str) -> list[pb.Event]:
        return [e for e in self.coord.events.since(0) if e.kind == kind]

    async def stored_steps(self) -> list[pb.StepRecord]:
        return [pb.StepRecord.FromString(v) for _, v in await self.store.get_prefix(STEPS_PREFIX)]

    # ---------------------------------------------------------- scripted agents

    async def start(self, layout: list[tuple[str, int]] | None = None) -> None:
        """Register one agent per replica (or `layout`), then report every replica ready."""
        layout = layout or [(f"a{i}", 1) for i in range(self.job.replicas)]
        for agent_id, slots in layout:
            await self.coord.register_agent(agent_id, "host-" + agent_id, slots)
        for replica in range(self.job.replicas):
            await self.coord.worker_ready(replica, pb.Ready(pid=100 + replica,
                                                             param_sha256="ab" * 32))
        assert self.coord.state is JobState.RUNNING

    def reduced_msg(self, replica: int, *, ids: tuple[int, ...] | None = None,
                    step: int | None = None, generation: int | None = None,
                    loss: float = 2.5) -> pb.Reduced:
        c = self.coord
        ids = c.plan[replica] if ids is None else ids
        return pb.Reduced(
            generation=c.generation if generation is None else generation,
            step=c.step if step is None else step,
            microbatch_ids=ids, sample_ids=[1000 * mb + k for mb in ids for k in range(2)],
            loss=loss, compute_s=0.1 + replica, reduce_s=0.01)

    async def reduce(self, replicas: list[int] | None = None) -> None:
        for replica in self.coord.members if replicas is None else replicas:
            await self.coord.reduced(replica, self.reduced_msg(replica))

    async def apply(self, step: int, digest: str = "cd" * 32,
                    replicas: list[int] | None = None) -> None:
        for replica in self.coord.members if replicas is None else replicas:
            await self.coord.applied(replica, pb.Applied(step=step, param_sha256=digest))


def plan_dict(plan: pb.Plan) -> dict[int, tuple[int, ...]]:
    return {a.replica: tuple(a.microbatch_ids) for a in plan.assignments}


def scenario(fn: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """Let a test be written as `async def` and run it with asyncio.run."""
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(fn(*args, **kwargs))
    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


# ---------------------------------------------------------------- registration

@scenario
async def test_registration_assigns_replica_ids_in_order():
    h = Harness(make_job(replicas=4))
    assert await h.coord.register_agent("a", "host-a", 2) == [0, 1]
    assert await h.coord.register_agent("b", "host-b", 1) == [2]
    assert await h.coord.register_agent("c", "host-c", 1) == [3]
    registered = h.messages("registered")
    assert [(a, list(r.replica_ids)) for a, r in registered] == [("a", [0, 1]), ("b", [2]),
                                                                  ("c", [3])]
    assert all(r.job == h.job for _, r in registered)
    assert {r: h.coord.replicas[r].agent_id for r in range(4)} == {0: "a", 1: "a", 2: "b", 3: "c"}
    stored = await h.store.get(f"/recover/{JOB_ID}/job")
    assert stored is not None and pb.JobConfig.FromString(stored) == h.job
    assert h.coord.state is JobState.WAITING


@pytest.mark.parametrize(("first", "attempt", "message"), [
    pytest.param([("a", 2)], ("b", 2), "job needs 3 replicas and has 2; 2 more slots do not fit",
                 id="more-slots-than-free"),
    pytest.param([("a", 3)], ("b", 1), "job needs 3 replicas and has 3; 1 more slots do not fit",
                 id="job-already-full"),
    pytest.param([("a", 1)], ("a", 1), "agent id 'a' is already registered",
                 id="duplicate-agent-id"),
    pytest.param([], ("a", 0), "an agent needs at least one slot, got 0", id="zero-slots"),
])
def test_registration_refused(first, attempt, message):
    async def body():
        h = Harness(make_job(replicas=3))
        for agent_id, slots in first:
            await h.coord.register_agent(agent_id, "h", slots)
        before = dict(h.coord.replicas)
        with pytest.raises(RegistrationRefused) as info:
            await h.coord.register_agent(attempt[0], "h", attempt[1])
        assert message in str(info.value)
        assert h.coord.replicas == before, "a refused registration must not take replica ids"
        assert len(h.messages("registered")) == len(first)
    asyncio.run(body())


@scenario
async def test_registration_after_start_refused():
    h = Harness(make_job(replicas=2))
    await h.start()
    with pytest.raises(RegistrationRefused, match=f"job {JOB_ID} is running; replicas cannot "
                                                  "join a started job"):
        await h.coord.register_agent("late", "h", 1)
    assert "late" not in h.coord.agents


# ---------------------------------------------------------------- start

@scenario
async def test_start_waits_for_every_replica_then_broadcasts_generation_1():
    h = Harness(make_job(replicas=3, m=8))
    await h.coord.register_agent("a", "h", 2)
    for replica in (0, 1):
        await h.coord.worker_ready(replica, pb.Ready(pid=1))
    # Two of three replicas exist and are ready: registration is incomplete.
    assert h.coord.state is JobState.WAITING and not h.messages("generation")
    await h.coord.register_agent("b", "h", 1)
    assert h.coord.state is JobState.WAITING and not h.messages("generation")
    await h.coord.worker_ready(2, pb.Ready(pid=3))
    assert h.coord.state is JobState.RUNNING
    views = h.messages("generation")
    assert [a for a, _ in views] == ["a", "b"], "one view per agent hosting members"
    for _, view in views:
        assert view.generation == 1
        assert list(view.members) == [0, 1, 2]
        assert view.rendezvous == RENDEZVOUS
        assert view.plan.step == 0 and view.plan.generation == 1
        assert plan_dict(view.plan) == {0: (0, 1, 2), 1: (3, 4, 5), 2: (6, 7)}
        assert "uniform: 8 microbatches over 3 replicas" in view.plan.reason
    stored = await h.store.get(f"/recover/{JOB_ID}/generation")
    assert stored is not None and pb.GenerationView.FromString(stored) == views[0][1]
    assert h.coord.started_at == h.clock.now


@scenario
async def test_ready_from_unknown_replica_is_stale_and_does_not_start():
    h = Harness(make_job(replicas=1))
    await h.coord.register_agent("a", "h", 1)
    await h.coord.worker_ready(5, pb.Ready(pid=1))
    assert h.coord.stale_reports == 1
    assert h.coord.state is JobState.WAITING


# ---------------------------------------------------------------- commit

@scenario
async def test_commit_needs_every_member():
    h = Harness(make_job(replicas=3, m=6))
    await h.start()
    await h.reduce([0, 1])
    await h.coord.reduced(0, h.reduced_msg(0))  # a repeated report still is one member
    assert not h.messages("commit"), "replica 2 has not reported; nothing may commit"
    assert await h.stored_steps() == [] and h.coord.step == 0
    await h.reduce([2])
    commits = h.messages("commit")
    assert [a for a, _ in commits] == ["a0", "a1", "a2"]
    commit = commits[0][1]
    assert (commit.step, commit.generation, commit.final) == (0, 1, False)
    assert commit.next_plan.step == 1 and commit.next_plan.generation == 1
    assert plan_dict(commit.next_plan) == {0: (0, 1), 1: (2, 3), 2: (4, 5)}
    assert h.coord.step == 1


@scenario
async def test_step_record_is_durable_before_commit_is_sent():
    h = Harness(make_job(replicas=2, m=4))
    await h.start()
    seen: list[list[tuple[str, bytes]]] = []

    def check_store(agent_id: str, message: pb.ControllerMessage) -> None:
        if message.WhichOneof("kind") == "commit":
            seen.append(run_now(h.store.get_prefix(STEPS_PREFIX)))

    h.on_send.append(check_store)
    h.clock.now = 1234.5
    await h.reduce()
    assert len(seen) == 2, "both agents got the commit"
    for snapshot in seen:
        assert [k for k, _ in snapshot] == [f"{STEPS_PREFIX}0000000000"]
        record = pb.StepRecord.FromString(snapshot[0][1])
        assert (record.step, record.generation, record.microbatches) == (0, 1, 4)
    record = pb.StepRecord.FromString(seen[0][0][1])
    samples = [1000 * mb + k for mb in range(4) for k in range(2)]
    assert record.sample_digest == sample_digest(reversed(samples))
    assert record.tokens == 4 * 2 * 8  # M * microbatch_size * seq_len
    assert record.loss == 2.5 and record.committed_at == 1234.5
    assert record.compute_s == pytest.approx(1.1)  # the slowest member
    assert h.coord.steps == [record]


def test_sample_digest_is_order_free_and_content_sensitive():
    assert sample_digest([3, 1, 2]) == sample_digest([1, 2, 3])
    assert sample_digest([1, 2, 3]) != sample_digest([1, 2, 4])
    assert sample_digest([1, 2]) != sample_digest([1, 2, 2])
    assert len(sample_digest([])) == 64


STALE_CASES = [
    pytest.param("older-generation", id="older-generation"),
    pytest.param("future-generation", id="future-generation"),
    pytest.param("wrong-step", id="wrong-step"),
    pytest.param("non-member", id="non-member"),
]


@pytest.mark.parametrize("case", STALE_CASES)
def test_stale_reduced_reports_are_counted_and_never_commit(case):
    async def body():
        h = Harness(make_job(replicas=3, m=6))
        await h.start()
        old_plan = dict(h.coord.plan)
        # Replica 2 dies: generation 2 with members [0, 1].
        await h.coord.worker_exited(pb.WorkerExited(replica=2, exit_code=1))
        assert h.coord.generation == 2 and h.coord.members == [0, 1]
        generation_sends = len(h.sent)
        if case == "older-generation":
            stale = [(r, h.reduced_msg(r, ids=old_plan[r], generation=1)) for r in (0, 1)]
        elif case == "future-generation":
            stale = [(r, h.reduced_msg(r, generation=3)) for r in (0, 1)]
        elif case == "wrong-step":
            stale = [(r, h.reduced_msg(r, step=1)) for r in (0, 1)]
        else:  # the lost replica and a replica that never existed
            stale = [(2, h.reduced_msg(0, generation=2)), (7, h.reduced_msg(1, generation=2))]
        for replica, msg in stale:
            await h.coord.reduced(replica, msg)
        assert h.coord.stale_reports == len(stale)
        assert len(h.sent) == generation_sends and not h.messages("commit")
        assert await h.stored_steps() == []
        if case == "non-member":
            await h.reduce([0])  # replica 2's stale report must not stand in for replica 1
            assert not h.messages("commit")
            await h.reduce([1])
        else:
            await h.reduce()
        commits = h.messages("commit")
        assert commits and commits[0][1].generation == 2
        assert h.coord.stale_reports == len(stale)
    asyncio.run(body())


@scenario
async def test_reduced_before_start_is_stale():
    h = Harness(make_job(replicas=1, m=2))
    await h.coord.register_agent("a", "h", 1)
    await h.coord.reduced(0, pb.Reduced(generation=0, step=0, microbatch_ids=[0, 1]))
    assert h.coord.stale_reports == 1 and not h.messages("commit")


@pytest.mark.parametrize(("reports", "problem"), [
    pytest.param({0: (0, 1), 1: (2,)}, "missing [3], duplicated []", id="missing"),
    pytest.param({0: (0, 1), 1: (1, 2, 3)}, "missing [], duplicated [1]", id="duplicated"),
])
def test_reports_that_do_not_cover_all_microbatches_fail_the_job(reports, problem):
    async def body():
        h = Harness(make_job(replicas=2, m=4))
        await h.start()
        for replica, ids in reports.items():
            await h.coord.reduced(replica, h.reduced_msg(replica, ids=ids))
        assert h.coord.state is JobState.FAILED
        assert "refusing to commit step 0" in h.coord.reason and problem in h.coord.reason
        assert not h.messages("commit") and await h.stored_steps() == []
        shutdowns = h.messages("shutdown")
        assert sorted(a for a, _ in shutdowns) == ["a0", "a1"]
        assert all(not s.success and s.reason == h.coord.reason for _, s in shutdowns)
        assert h.coord.done.is_set()
        assert h.events("failed")
    asyncio.run(body())


# ---------------------------------------------------------------- failures

@scenario
async def test_worker_exit_mid_step_makes_generation_2_keeping_survivors_ids():
    h = Harness(make_job(replicas=3, m=6))
    await h.start()
    assert h.coord.plan == {0: (0, 1), 1: (2, 3), 2: (4, 5)}
    await h.reduce([0])  # progress of generation 1 must not count in generation 2
    h.clock.now = 1010.0
    await h.coord.worker_exited(pb.WorkerExited(
        replica=1, signal=9, observed_at=1009.9,
        fault=pb.FaultNote(step=0, phase="backward", killed_at=1009.5)))
    views = h.messages("generation")[3:]  # after the three views of generation 1
    assert [a for a, _ in views] == ["a0", "a2"], "no view for an agent without members"
    view = views[0][1]
    assert view.generation == 2 and list(view.members) == [0, 2]
    assert view.plan.step == 0 and view.plan.generation == 2
    assert plan_dict(view.plan) == {0: (0, 1, 2), 2: (4, 5, 3)}
    assert "replicas [1] lost" in view.plan.reason
    assert h.coord.recoveries == 1
    [failure] = h.coord.failures
    assert (failure.step, failure.replica, failure.cause, failure.phase) == (0, 1, "injected",
                                                                             "backward")
    assert failure.killed_at == 1009.5 and failure.detected_at == 1010.0
    assert failure.generation == 1 and failure.recovered_at == 0
    assert h.events("replica-failed")[0].replica == 1
    # Only the survivors' reports in generation 2 commit the step.
    await h.reduce([0])
    assert not h.messages("commit")
    await h.reduce([2])
    [(_, commit), _] = h.messages("commit")
    assert (commit.step, commit.generation) == (0, 2)
    assert plan_dict(commit.next_plan) == {0: (0, 1, 2), 2: (3, 4, 5)}


@pytest.mark.parametrize(("resumed", "reduced", "phase"), [
    pytest.param(False, False, "rebuild", id="before-resumed"),
    pytest.param(True, False, "compute", id="computing"),
    pytest.param(True, True, "commit", id="after-reducing"),
])
def test_external_exit_records_observed_phase(resumed, reduced, phase):
    async def body():
        h = Harness(make_job(replicas=2, m=4))
        await h.start()
        if resumed:
            await h.coord.resumed(1, pb.Resumed(generation=1, step=0, at=1000.0))
        if reduced:
            await h.reduce([1])
        await h.coord.worker_exited(pb.WorkerExited(replica=1, exit_code=3))
        [failure] = h.coord.failures
        assert (failure.cause, failure.phase, failure.step) == ("external", phase, 0)
        assert h.coord.generation == 2 and h.coord.members == [0]
    asyncio.run(body())


@scenario
async def test_two_replicas_of_one_agent_lost_at_once():
    h = Harness(make_job(replicas=4, m=8))
    await h.start([("a", 2), ("b", 2)])
    await h.coord.agent_lost("b", "session closed")
    assert h.coord.generation == 2 and h.coord.members == [0, 1]
    assert h.coord.plan == {0: (0, 1, 4, 6), 1: (2, 3, 5, 7)}
    assert [(f.replica, f.cause) for f in h.coord.failures] == [(2, "agent-lost"),
                                                                (3, "agent-lost")]
    assert h.coord.recoveries == 1
    await h.coord.agent_lost("b", "again")  # idempotent
    assert h.coord.generation == 2 and len(h.coord.failures) == 2


@scenario
async def test_losing_every_replica_fails_the_job():
    h = Harness(make_job(replicas=2, m=4))
    await h.start()
    await h.coord.worker_exited(pb.WorkerExited(replica=0, exit_code=1))
    assert h.coord.state is JobState.RUNNING and h.coord.generation == 2
    await h.coord.worker_exited(pb.WorkerExited(replica=1, signal=9))
    assert h.coord.state is JobState.FAILED
    assert "all replicas lost" in h.coord.reason and "signal 9" in h.coord.reason
    assert h.coord.generation == 2, "no generation without members"
    assert [s.success for _, s in h.messages("shutdown")] == [False, False]
    assert h.coord.done.is_set()
    # Events are flushed to the store when the job ends.
    stored = await h.store.get_prefix(f"/recover/{JOB_ID}/events/")
    assert [pb.Event.FromString(v).kind for _, v in stored][-1] == "failed"
    assert len(stored) == len(h.coord.events)


@scenario
async def test_worker_exit_before_start_fails_the_job():
    h = Harness(make_job(replicas=2))
    await h.coord.register_agent("a", "h", 2)
    await h.coord.worker_ready(0, pb.Ready(pid=1))
    await h.coord.worker_exited(pb.WorkerExited(replica=1, exit_code=2))
    assert h.coord.state is JobState.FAILED
    assert h.coord.reason == "replica 1 exited (exit code 2) before training started"
    assert [f.phase for f in h.coord.failures] == ["startup"]
    assert not h.messages("generation")
    assert [(a, s.success) for a, s in h.messages("shutdown")] == [("a", False)]
    await h.coord.worker_ready(0, pb.Ready(pid=1))
    assert h.coord.state is JobState.FAILED and h.coord.stale_reports == 1


@scenario
async def test_agent_lost_before_start_fails_the_job():
    h = Harness(make_job(replicas=2))
    await h.coord.register_agent("a", "h", 1)
    await h.coord.register_agent("b", "h", 1)
    await h.coord.agent_lost("b", "session closed")
    assert h.coord.state is JobState.FAILED
    assert "before training started" in h.coord.reason and "agent b lost" in h.coord.reason
    # The lost agent is told to stand down first (fencing, should it wake up), then everyone.
    shutdowns = h.messages("shutdown")
    assert [a for a, _ in shutdowns] == ["b", "a"]
    assert "declared lost" in shutdowns[0][1].reason and not shutdowns[0][1].success


# ---------------------------------------------------------------- the end

@scenario
async def test_final_step_succeeds_only_after_every_member_applied():
    h = Harness(make_job(replicas=2, steps=2, m=4))
    await h.start()
    await h.reduce()
    await h.apply(0)
    await h.reduce()
    [_, (_, final)] = [c for c in h.messages("commit") if c[0] == "a0"]
    assert final.step == 1 and final.final and not final.HasField("next_plan")
    assert h.coord.state is JobState.RUNNING
    await h.apply(1, replicas=[0])
    assert h.coord.state is JobState.RUNNING and not h.messages("shutdown")
    h.clock.now = 1100.0
    await h.apply(1, replicas=[1])
    assert h.coord.state is JobState.SUCCEEDED
    assert h.coord.reason == "2 steps committed" and h.coord.finished_at == 1100.0
    shutdowns = h.messages("shutdown")
    assert sorted(a for a, _ in shutdowns) == ["a0", "a1"]
    assert all(s.success for _, s in shutdowns)
    assert h.coord.done.is_set()
    assert [r.step for r in await h.stored_steps()] == [0, 1]
    assert not h.events("divergence")


@scenario
async def test_member_lost_while_final_step_is_acknowledged():
    h = Harness(make_job(replicas=3, steps=1, m=3))
    await h.start()
    await h.reduce()
    await h.apply(0, replicas=[0, 1])
    assert h.coord.state is JobState.RUNNING
    await h.coord.worker_exited(pb.WorkerExited(replica=2, exit_code=1))
    assert h.coord.state is JobState.SUCCEEDED
    assert h.coord.generation == 1, "no new generation after the final commit"


@scenario
async def test_divergent_applied_digests_emit_divergence():
    h = Harness(make_job(replicas=2, steps=2, m=4))
    await h.start()
    await h.reduce()
    await h.apply(0, digest="aa" * 32, replicas=[0])
    assert not h.events("divergence")
    await h.apply(0, digest="bb" * 32, replicas=[1])
    [event] = h.events("divergence")
    assert event.step == 0 and "disagree" in event.message
    assert {(d.replica, d.param_sha256) for d in h.coord.steps[0].param_sha256} == {
        (0, "aa" * 32), (1, "bb" * 32)}


@scenario
async def test_applied_for_uncommitted_step_is_stale():
    h = Harness(make_job(replicas=1, steps=1, m=1))
    await h.start()
    await h.coord.applied(0, pb.Applied(step=0, param_sha256="x"))
    assert h.coord.stale_reports == 1 and h.coord.state is JobState.RUNNING


# ---------------------------------------------------------------- liveness

@scenario
async def test_check_liveness_declares_a_silent_agent_lost():
    h = Harness(make_job(replicas=2, m=4), agent_timeout_s=3.0)
    await h.start()  # both agents registered at t=1000
    h.clock.now = 1002.5
    h.coord.heartbeat("a0")
    h.coord.heartbeat("nobody")  # unknown agents are ignored
    h.clock.now = 1003.0
    await h.coord.check_liveness()
    assert h.coord.generation == 1, "3.0s of silence is not more than the timeout"
    h.clock.now = 1004.0
    await h.coord.check_liveness()
    assert not h.coord.agents["a1"].alive and h.coord.agents["a0"].alive
    assert h.coord.generation == 2 and h.coord.members == [0]
    [lost] = h.events("agent-lost")
    assert "agent a1: no heartbeat for 4.0s" in lost.message
    assert [(f.replica, f.cause, f.detected_at) for f in h.coord.failures] == [
        (1, "agent-lost", 1004.0)]
    assert h.coord.state is JobState.RUNNING


@scenario
async def test_check_liveness_fails_a_job_that_never_starts():
    h = Harness(make_job(replicas=2), agent_timeout_s=1e9)
    await h.coord.register_agent("a", "h", 1)
    await h.coord.worker_ready(0, pb.Ready(pid=1))
    h.clock.now += h.coord.start_timeout_s
    await h.coord.check_liveness()
    assert h.coord.state is JobState.WAITING
    h.clock.now += 1
    await h.coord.check_liveness()
    assert h.coord.state is JobState.FAILED
    assert "only 1 of 2 replicas were ready after 120s" in h.coord.reason


# ---------------------------------------------------------------- recovery time

@scenario
async def test_resumed_from_every_member_sets_recovered_at():
    h = Harness(make_job(replicas=3, m=6))
    await h.start()
    h.clock.now = 1010.0
    await h.coord.worker_exited(pb.WorkerExited(replica=1, signal=9))
    [failure] = h.coord.failures
    await h.coord.resumed(0, pb.Resumed(generation=1, step=0, at=1011.0))  # old generation
    await h.coord.resumed(1, pb.Resumed(generation=2, step=0, at=1011.0))  # not a member
    assert h.coord.stale_reports == 2
    await h.coord.resumed(0, pb.Resumed(generation=2, step=0, at=1011.25))
    assert failure.recovered_at == 0 and not h.events("recovered")
    await h.coord.resumed(2, pb.Resumed(generation=2, step=0, at=1011.5))
    assert failure.recovered_at == 1011.5
    [event] = h.events("recovered")
    assert "1.500s after detection" in event.message and event.generation == 2
    # A later resume in the same generation does not move the recorded time.
    await h.coord.resumed(0, pb.Resumed(generation=2, step=0, at=1020.0))
    assert failure.recovered_at == 1011.5 and len(h.events("recovered")) == 1


@scenario
async def test_overflow_redoes_the_step_then_fails_instead_of_looping():
    """A gradient that never fits (NaN/inf) must end the job, not redo it forever."""
    h = Harness(make_job(replicas=2, m=4))
    await h.start()
    for epoch in range(1, 4):
        for replica in h.coord.members:
            await h.coord.reduced(replica, pb.Reduced(
                **{**_fields(h.reduced_msg(replica)), "overflow": 1}))
        assert h.coord.state is JobState.RUNNING
        assert (h.coord.scale_epoch, h.coord.step) == (epoch, 0)
        generation = h.messages("generation")[-1][1]
        assert generation.plan.scale_epoch == epoch, "the redo must carry the lower scale"
    assert not h.messages("commit")
    for replica in h.coord.members:
        await h.coord.reduced(replica, pb.Reduced(
            **{**_fields(h.reduced_msg(replica)), "overflow": 1}))
    assert h.coord.state is JobState.FAILED
    assert "still overflow after 3 rescalings" in h.coord.reason
    assert "non-finite" in h.coord.reason
    assert not h.messages("commit") and await h.stored_steps() == []


def _fields(message: pb.Reduced) -> dict[str, Any]:
    return {f.name: v for f, v in message.ListFields()}
