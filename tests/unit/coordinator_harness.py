"""Test harness for the coordinator: MemoryStore, a recording `send`, a fake clock.

No network, no processes: every test builds a Coordinator inside asyncio.run
and feeds it the calls the gRPC layer would make.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from recover.controller.coordinator import Coordinator, JobState
from recover.controller.store import MemoryStore
from recover.proto import pb

JOB_ID = "job-unit"
STEPS_PREFIX = f"/recover/{JOB_ID}/steps/"
RENDEZVOUS = "127.0.0.1:29999"


def make_job(replicas: int = 2, steps: int = 2, m: int = 4,
             policy: str = "recover") -> pb.JobConfig:
    """`policy`: the count policy by default, whose plans these tests spell out (the
    harness's reports carry made-up compute times a proportional plan would follow)."""
    return pb.JobConfig(
        job_id=JOB_ID, replicas=replicas, steps=steps, global_microbatches=m, seed=0,
        reduce="fast", policy=policy, workload=pb.WorkloadSpec(command=["python", "train.py"]))


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

    async def settle(self) -> None:
        """Let the coordinator's end-of-pass work run (its work-stealing decisions are made
        once per pass of the event loop, after the reports it read)."""
        await asyncio.sleep(0)

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
        for replica in sorted(self.coord.replicas):  # spares too
            await self.coord.worker_ready(replica, pb.Ready(
                pid=100 + replica, param_sha256="ab" * 32,
                transfer_address=f"10.0.0.{replica}:7000"))
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
            loss=loss, compute_s=0.1 + replica, reduce_s=0.01, tokens=16 * len(ids))

    async def reduce(self, replicas: list[int] | None = None) -> None:
        for replica in self.coord.members if replicas is None else replicas:
            await self.coord.reduced(replica, self.reduced_msg(replica))

    async def apply(self, step: int, digest: str = "cd" * 32,
                    replicas: list[int] | None = None) -> None:
        for replica in self.coord.members if replicas is None else replicas:
            await self.coord.applied(replica, pb.Applied(step=step, param_sha256=digest))


async def with_a_spare() -> tuple[Harness, pb.Join]:
    """A started job of 2 members (M = 4) and replica 2 on agent "spare" that loaded a
    snapshot of step 0: the job has its members, so it waits as a hot spare."""
    h = Harness(make_job(replicas=2, steps=10, m=4))
    h.job.spares = 1
    await h.start()
    await h.coord.register_agent("spare", "h", 1)  # room for one spare
    await h.coord.worker_ready(2, pb.Ready(pid=102, transfer_address="10.0.0.2:7000"))
    join = h.messages("join")[-1][1]
    h.coord.joins.progress(2, pb.JoinProgress(step=0, donor=join.donor, attempt=join.attempt))
    return h, join


def plan_dict(plan: pb.Plan) -> dict[int, tuple[int, ...]]:
    return {a.replica: tuple(a.microbatch_ids) for a in plan.assignments}


def scenario(fn: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """Let a test be written as `async def` and run it with asyncio.run."""
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(fn(*args, **kwargs))
    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper
