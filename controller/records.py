"""What a controller keeps of a job in its store, and the one place that spells its keys.

The layout, under `/recover/{job_id}/` (one folder per job, so jobs never mix):

| key | value | written |
|---|---|---|
| `job` | JobConfig | at the first registration; again when an operator changes the spares |
| `agents/{agent_id}` | AgentRecord | before an agent learns its replicas (and their join addresses) |
| `workload` | WorkloadInfo | at the start (what the workers train, from their `ready`) |
| `generation` | GenerationView | before a generation is broadcast, with the events that led to it |
| `steps/{step:010d}` | StepRecord | before a commit is broadcast; again with the digests members report |
| `plan` | Plan | with each commit that hands the workers the next step's plan |
| `failures/{n:06d}` | FailureRecord | with the next write (deferred like the events) |
| `events/{seq:012d}` | Event | behind the critical path, or riding along with a generation |
| `result` | Shutdown | when the job ends |
| `leader`, `term` | LeaderRecord, term | by the leader election (leader.py) |

Every record a new leader needs is written before the act it records, so `load()` gives
it a job it can carry on exactly: the committed steps, the generation in force, and the
plan the workers hold. The plan is stored, never re-derived: the moment quotas are not
uniform, a plan recomputed by a successor would differ from the one the workers hold.
Patroni's `AbstractDCS` returning an immutable `Cluster` is the model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TypeVar

from recover.controller.store import Store
from recover.proto import pb

KeyValue = tuple[str, bytes]
"""A key and its value, to be written together with others in one store transaction."""


@dataclass(frozen=True)
class JobKeys:
    """The store keys of one job."""

    job_id: str

    @property
    def root(self) -> str:
        return f"/recover/{self.job_id}/"

    @property
    def job(self) -> str:
        return self.root + "job"

    @property
    def generation(self) -> str:
        return self.root + "generation"

    @property
    def plan(self) -> str:
        return self.root + "plan"

    @property
    def workload(self) -> str:
        return self.root + "workload"

    @property
    def result(self) -> str:
        return self.root + "result"

    @property
    def leader(self) -> str:
        return self.root + "leader"

    @property
    def term(self) -> str:
        return self.root + "term"

    @property
    def steps(self) -> str:
        return self.root + "steps/"

    @property
    def agents(self) -> str:
        return self.root + "agents/"

    @property
    def events(self) -> str:
        return self.root + "events/"

    @property
    def failures(self) -> str:
        return self.root + "failures/"

    def step(self, step: int) -> str:
        return f"{self.steps}{step:010d}"

    def agent(self, agent_id: str) -> str:
        return self.agents + agent_id

    def event(self, seq: int) -> str:
        return f"{self.events}{seq:012d}"

    def failure(self, number: int) -> str:
        return f"{self.failures}{number:06d}"


@dataclass
class PersistedJob:
    """What the store holds of a job (everything a new leader rebuilds from)."""

    job: pb.JobConfig | None = None
    view: pb.GenerationView | None = None
    """The last generation, written before it was broadcast (None: the job never started)."""
    plan: pb.Plan | None = None
    """The plan the last commit handed the workers for the next step (None: no commit did)."""
    steps: list[pb.StepRecord] = field(default_factory=list)
    agents: list[pb.AgentRecord] = field(default_factory=list)
    failures: list[pb.FailureRecord] = field(default_factory=list)
    events: list[pb.Event] = field(default_factory=list)
    result: pb.Shutdown | None = None
    """How the job ended, when it did (a new leader then only serves its status)."""
    workload: pb.WorkloadInfo | None = None
    """What the workers train, as the first ready replica reported it."""

    @property
    def empty(self) -> bool:
        return self.job is None and not self.agents

    def plan_held_for(self, step: int) -> tuple[pb.Plan | None, str]:
        """The plan the workers hold for `step`, and where it comes from (None: they hold
        none, because the commit before it went out without one: joiners or drains were
        to change the membership, and the generation that would have planned it was never
        written)."""
        view, stored = self.view, self.plan
        if view is not None and view.plan.step == step:
            if (stored is not None and stored.step == step
                    and stored.generation == view.generation
                    and stored.version > view.plan.version):
                return stored, (f"generation {view.generation}'s plan of step {step} after "
                                f"{stored.version} steal{'s' if stored.version > 1 else ''}")
            return view.plan, f"generation {view.generation}'s plan of step {step}"
        if self.plan is not None and self.plan.step == step:
            return self.plan, f"the plan of step {step} stored with the last commit"
        return None, f"no plan of step {step} was handed out"


M = TypeVar("M", pb.JobConfig, pb.GenerationView, pb.Plan, pb.Shutdown, pb.WorkloadInfo,
              pb.StepRecord, pb.AgentRecord, pb.FailureRecord, pb.Event)


def _parsed(kind: type[M], raw: bytes | None) -> M | None:
    return kind.FromString(raw) if raw else None


STORE_WRITE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
"""Upper bounds (s) of `recover_store_write_seconds`: the memory store writes in
microseconds, etcd on a local disk in about a millisecond, a slow disk in tens."""


class WriteLatency:
    """How long the store took for each write (one put or one transaction), counted into
    histogram buckets as it happens: a scrape reads counters, and a long job keeps no list."""

    def __init__(self) -> None:
        self.buckets = [0] * len(STORE_WRITE_BUCKETS)
        """Writes that took at most each bound (cumulative, as Prometheus wants them)."""
        self.count = 0
        self.total_s = 0.0

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        for index, bound in enumerate(STORE_WRITE_BUCKETS):
            if seconds <= bound:
                self.buckets[index] += 1


class Records:
    """Reads and writes a job's records; the only code that knows the keys (JobKeys)."""

    def __init__(self, store: Store, job_id: str) -> None:
        self.store = store
        self.keys = JobKeys(job_id)
        self.write_latency = WriteLatency()

    async def put(self, key: str, value: bytes) -> None:
        started = time.perf_counter()
        await self.store.put(key, value)
        self.write_latency.observe(time.perf_counter() - started)

    async def put_many(self, writes: list[KeyValue]) -> None:
        """Several records in one transaction (every write of a job's records is timed)."""
        started = time.perf_counter()
        await self.store.put_many(writes)
        self.write_latency.observe(time.perf_counter() - started)

    # ------------------------------------------------------------ writes

    async def save_job(self, job: pb.JobConfig) -> None:
        await self.put(self.keys.job, job.SerializeToString())

    async def save_agent(self, job: pb.JobConfig, agent: pb.AgentRecord) -> None:
        """An agent's replicas, with the job (so a new leader never finds agents without it)."""
        await self.put_many([(self.keys.job, job.SerializeToString()),
                                   (self.keys.agent(agent.agent_id), agent.SerializeToString())])

    async def save_workload(self, workload: pb.WorkloadInfo) -> None:
        await self.put(self.keys.workload, workload.SerializeToString())

    async def save_view(self, view: pb.GenerationView, riding_along: list[KeyValue]) -> None:
        """A generation, before anyone hears of it; `riding_along`: deferred writes (events,
        failures) that must not be lost with a leader deposed right after."""
        await self.put_many([*riding_along, (self.keys.generation, view.SerializeToString())])

    async def commit_step(self, record: pb.StepRecord, previous: pb.StepRecord | None,
                          next_plan: pb.Plan | None) -> None:
        """A step commits: its record, the plan the workers will hold next (when the commit
        carries one) and the previous record with the digests its members reported since,
        in one write, before any member is told to apply it."""
        writes = [(self.keys.step(record.step), record.SerializeToString())]
        if previous is not None:
            writes.append((self.keys.step(previous.step), previous.SerializeToString()))
        if next_plan is not None:
            writes.append((self.keys.plan, next_plan.SerializeToString()))
        await self.put_many(writes)

    async def save_plan(self, plan: pb.Plan) -> None:
        """The step in flight's plan as a steal changed it (work-stealing)."""
        await self.put(self.keys.plan, plan.SerializeToString())

    async def save_step(self, record: pb.StepRecord) -> None:
        """A committed step's record again (with the parameter digests reported since)."""
        await self.put(self.keys.step(record.step), record.SerializeToString())

    async def save_result(self, result: pb.Shutdown) -> None:
        await self.put(self.keys.result, result.SerializeToString())

    def event_write(self, event: pb.Event) -> KeyValue:
        return self.keys.event(event.seq), event.SerializeToString()

    def failure_write(self, number: int, failure: pb.FailureRecord) -> KeyValue:
        return self.keys.failure(number), failure.SerializeToString()

    # ------------------------------------------------------------ reads

    async def load(self) -> PersistedJob:
        keys, store = self.keys, self.store

        async def values(prefix: str, kind: type[M]) -> list[M]:
            return [kind.FromString(v) for _, v in await store.get_prefix(prefix)]

        return PersistedJob(
            job=_parsed(pb.JobConfig, await store.get(keys.job)),
            view=_parsed(pb.GenerationView, await store.get(keys.generation)),
            plan=_parsed(pb.Plan, await store.get(keys.plan)),
            steps=await values(keys.steps, pb.StepRecord),
            agents=await values(keys.agents, pb.AgentRecord),
            failures=await values(keys.failures, pb.FailureRecord),
            events=await values(keys.events, pb.Event),
            result=_parsed(pb.Shutdown, await store.get(keys.result)),
            workload=_parsed(pb.WorkloadInfo, await store.get(keys.workload)))

