"""The step executor in one process: replicas are threads, the group is the in-process fake
(trainer/groups/fake.py), the controller a small fake that plays the real one's part.

Each test kills a replica at one point of a step (forward, backward, inside the reduce,
after reporting the reduction but before the commit) and checks that the survivors end
with parameters bitwise equal to the failure-free run's, in exact mode: the lost
microbatches were recomputed by the survivors, and what they had accumulated survived the
failed collective (which leaves partially reduced buffers behind, as gloo does).

The kills are the job's own fault hooks (trainer/faults.py) with a `kill` that ends the
replica's thread instead of SIGKILLing the process; the reduce-phase kill is the fake
group's. Nothing here waits on time: queues and the fake's barriers order everything,
and their timeouts are only safety nets.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

from recover.proto import pb
from recover.trainer.buffers import reduced_buckets
from recover.trainer.executor import StepExecutor
from recover.trainer.faults import FaultHooks, FaultInjector
from recover.trainer.gradients import GradientBuckets
from recover.trainer.groups.fake import FakeRendezvous, MemberKilled
from recover.trainer.reduction import make_accumulator
from recover.trainer.slowdown import SlowdownSchedule
from recover.trainer.sources import FunctionMicrobatches
from recover.trainer.workload import Workload

torch.set_num_threads(1)

SEED = 7
M = 6
STEPS = 4
REPLICAS = 3
SAFETY_S = 60.0
"""No test should come near this: it only turns a hang into a failure."""


def data(step: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Its own generator: the replicas' threads share torch's default one.
    gen = torch.Generator().manual_seed(step * 1000 + microbatch)
    x = torch.randn(4, 4, generator=gen)
    return x, x.sum(1, keepdim=True).sin()


def mse(model: nn.Module, batch: Any) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def die() -> None:
    raise MemberKilled("killed by an injected fault")


class FakeChannel:
    """A replica's end of its agent's channel (trainer/channel.py's interface)."""

    def __init__(self, replica: int, events: queue.Queue[tuple[Any, ...]]) -> None:
        self.replica = replica
        self._events = events
        self._incoming: queue.Queue[pb.WorkerCommand] = queue.Queue()
        self._on_generation: Any = None

    def set_generation_hook(self, hook: Any) -> None:
        self._on_generation = hook

    def deliver(self, command: pb.WorkerCommand) -> None:
        # As the real receiver thread does: a new generation aborts the old group at once.
        if command.WhichOneof("kind") == "generation" and self._on_generation is not None:
            self._on_generation(command.generation.generation)
        self._incoming.put(command)

    def send(self, report: pb.WorkerReport) -> None:
        report.replica = self.replica
        self._events.put(("report", report))

    def next_command(self, timeout_s: float | None = None) -> pb.WorkerCommand | None:
        try:
            return self._incoming.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def poll(self) -> pb.WorkerCommand | None:
        try:
            return self._incoming.get_nowait()
        except queue.Empty:
            return None

    def note_fault(self, note: pb.FaultNote) -> None:
        pass


@dataclass
class FakeController:
    """The controller's part: generations, plans, the commit protocol, on the test's thread.

    `hold` names steps whose commit waits for a loss even when every member has reported:
    the real controller may see a loss before or after the last report; the test chooses.
    """

    replicas: list[int]
    hold: set[int] = field(default_factory=set)
    events: queue.Queue[tuple[Any, ...]] = field(default_factory=queue.Queue)
    channels: dict[int, FakeChannel] = field(default_factory=dict)
    members: list[int] = field(default_factory=list)
    generation: int = 0
    step: int = 0
    plan: dict[int, list[int]] = field(default_factory=dict)
    reduced: dict[int, pb.Reduced] = field(default_factory=dict)
    compute_s: dict[tuple[int, int], float] = field(default_factory=dict)
    """(step, replica) -> the compute time its reduction reported."""
    leads: dict[tuple[int, int], float] = field(default_factory=dict)
    """(step, replica) -> the lead its reduction reported (pb.Reduced.lead_s)."""
    commits: list[tuple[int, int]] = field(default_factory=list)
    """(step, generation) of every commit."""
    digests: dict[int, dict[int, str]] = field(default_factory=lambda: defaultdict(dict))
    folded: int = 0
    """`applied` reports that came inside a `reduced` one."""
    """step -> replica -> parameter digest after applying it."""
    lost: list[int] = field(default_factory=list)
    ended: dict[int, Any] = field(default_factory=dict)
    ready: set[int] = field(default_factory=set)

    def uniform(self, members: list[int]) -> dict[int, list[int]]:
        share = -(-M // len(members))
        return {r: list(range(i * share, min(M, (i + 1) * share))) for i, r in enumerate(members)}

    def send(self, replicas: list[int], **command: Any) -> None:
        for replica in replicas:
            self.channels[replica].deliver(pb.WorkerCommand(**command))

    def new_generation(self) -> None:
        self.generation += 1
        self.reduced = {}
        view = pb.GenerationView(
            generation=self.generation, members=self.members, rendezvous="fake:0",
            plan=self.as_plan(self.step, self.plan))
        self.send(self.members, generation=view)

    def as_plan(self, step: int, plan: dict[int, list[int]]) -> pb.Plan:
        return pb.Plan(step=step, generation=self.generation, assignments=[
            pb.Assignment(replica=r, microbatch_ids=ids) for r, ids in sorted(plan.items())])

    def on_report(self, report: pb.WorkerReport) -> None:
        kind = report.WhichOneof("kind")
        if kind == "ready":
            self.ready.add(report.replica)
            if self.ready == set(self.replicas):
                self.members = sorted(self.ready)
                self.plan = self.uniform(self.members)
                self.new_generation()
        elif kind == "reduced":
            r = report.reduced
            for applied in r.applied:  # earlier steps' applied reports, folded in
                self.on_report(pb.WorkerReport(replica=report.replica, applied=applied))
            self.folded += len(r.applied)
            if r.generation == self.generation and r.step == self.step:
                self.reduced[report.replica] = r
                self.compute_s[(r.step, report.replica)] = r.compute_s
                self.leads[(r.step, report.replica)] = r.lead_s
                self.maybe_commit()
        elif kind == "applied":
            self.digests[report.applied.step][report.replica] = report.applied.param_sha256
            if report.applied.step == STEPS - 1 and \
                    set(self.digests[STEPS - 1]) >= set(self.members):
                self.send(self.members, shutdown=pb.Shutdown(reason="done", success=True,
                                                             state="succeeded"))

    def maybe_commit(self) -> None:
        if set(self.reduced) != set(self.members) or self.step in self.hold:
            return
        computed = sorted(mb for r in self.reduced.values() for mb in r.microbatch_ids)
        assert computed == list(range(M)), f"step {self.step} summed microbatches {computed}"
        assert all(r.overflow == 0 for r in self.reduced.values())
        final = self.step == STEPS - 1
        commit = pb.Commit(step=self.step, generation=self.generation, final=final,
                           microbatches=M)
        self.plan = {} if final else self.uniform(self.members)
        if not final:
            commit.next_plan.CopyFrom(self.as_plan(self.step + 1, self.plan))
        self.commits.append((self.step, self.generation))
        self.send(self.members, commit=commit)
        self.step += 1
        self.reduced = {}

    def on_lost(self, replica: int) -> None:
        """A replica died: its microbatches go round-robin to the survivors, who keep theirs."""
        self.lost.append(replica)
        self.members = [r for r in self.members if r != replica]
        orphans = self.plan.pop(replica, [])
        for i, survivor in enumerate(self.members):
            self.plan[survivor] = self.plan[survivor] + orphans[i::len(self.members)]
        self.hold.discard(self.step)  # the loss a held commit waited for
        self.new_generation()

    def run(self, threads: list[threading.Thread]) -> None:
        deadline = time.monotonic() + SAFETY_S
        while len(self.ended) < len(threads):
            event = self.events.get(timeout=max(deadline - time.monotonic(), 0.001))
            if event[0] == "report":
                self.on_report(event[1])
            elif event[0] == "lost":
                self.on_lost(event[1])
            elif event[0] == "ended":
                self.ended[event[1]] = event[2]


@dataclass
class Run:
    controller: FakeController
    rendezvous: FakeRendezvous
    executors: dict[int, StepExecutor]

    def params(self, replica: int) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.executors[replica].workload.model.parameters()]


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def replica_executor(replica: int, reduce: str, channel: FakeChannel, rendezvous: FakeRendezvous,
                     faults: list[pb.FaultSpec], slowdowns: list[pb.SlowdownSpec],
                     sleep: Any, build: Callable[[], nn.Module] = mlp,
                     buffers: str = "reduce", source_of: Callable[[], Any] | None = None,
                     piece_bytes: int = 0) -> StepExecutor:
    torch.manual_seed(SEED)  # every replica builds the same model (on the test's thread)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    source = source_of() if source_of is not None else FunctionMicrobatches(data)
    source.bind(M, SEED)
    workload = Workload(model=model, optimizer=optimizer, source=source, seed=SEED, loss_fn=mse,
                        buffers=buffers)
    grads = GradientBuckets(workload.params)
    job = pb.JobConfig(job_id="fake", replicas=REPLICAS, steps=STEPS, global_microbatches=M,
                       seed=SEED, reduce=reduce, group_timeout_s=SAFETY_S)
    hooks = FaultHooks(FaultInjector(faults, replica, channel.note_fault, kill=die),
                       slowdown=SlowdownSchedule(slowdowns, replica), sleep=sleep)
    return StepExecutor(job, replica, channel, workload, grads,
                        make_accumulator(reduce, reduced_buckets(grads, workload.model_buffers), M,
                                         piece_bytes=piece_bytes),
                        hooks=hooks, groups=rendezvous)


def train(reduce: str = "exact", faults: tuple[pb.FaultSpec, ...] = (), hold: set[int] | None = None,
          crash_in_allreduce: tuple[int, int] | None = None,
          slowdowns: tuple[pb.SlowdownSpec, ...] = (), sleep: Any = None,
          build: Callable[[], nn.Module] = mlp, buffers: str = "reduce",
          background_digests: bool | None = None,
          source_of: Callable[[], Any] | None = None,
          controller_of: Callable[..., FakeController] = FakeController,
          prepare: Callable[[dict[int, StepExecutor]], None] | None = None,
          piece_bytes: int = 0) -> Run:
    """Train STEPS steps with REPLICAS replica threads; returns when every thread ended.
    `controller_of` makes the fake controller; `prepare` may change the executors first."""
    controller = controller_of(list(range(REPLICAS)), hold=set(hold or ()))
    rendezvous = FakeRendezvous(timeout_s=SAFETY_S)
    if crash_in_allreduce is not None:
        rendezvous.world(1, REPLICAS).crash_during_allreduce(*crash_in_allreduce)
    executors = {}
    for replica in controller.replicas:
        controller.channels[replica] = FakeChannel(replica, controller.events)
        executors[replica] = replica_executor(replica, reduce, controller.channels[replica],
                                              rendezvous, list(faults), list(slowdowns), sleep,
                                              build, buffers, source_of, piece_bytes)
        executors[replica].background_digests = background_digests
    if prepare is not None:
        prepare(executors)

    def life(executor: StepExecutor) -> None:
        try:
            outcome: Any = executor.run(pb.Ready(param_sha256=executor.workload.digest()))
        except MemberKilled:
            controller.events.put(("lost", executor.replica))
            outcome = "killed"
        except BaseException as exc:  # noqa: BLE001 - reported to the test's thread
            outcome = exc
        controller.events.put(("ended", executor.replica, outcome))

    threads = [threading.Thread(target=life, args=(e,), daemon=True, name=f"replica-{r}")
               for r, e in executors.items()]
    for thread in threads:
        thread.start()
    try:
        controller.run(threads)
    finally:  # a failed test must not leave threads waiting for commands
        controller.send(list(controller.channels), shutdown=pb.Shutdown(reason="test over"))
    for thread in threads:
        thread.join(SAFETY_S)
    errors = {r: o for r, o in controller.ended.items() if isinstance(o, BaseException)}
    assert not errors, errors
    return Run(controller, rendezvous, executors)


def failure_free() -> Run:
    """The failure-free run the tests compare with. Digests hashed in line: every run of the
    tests hashes them on a thread (the default), so each comparison of digests step by step
    also checks those against these."""
    run = train(background_digests=False)
    assert run.controller.commits == [(s, 1) for s in range(STEPS)]
    assert run.controller.lost == []
    return run


@pytest.fixture(scope="module")
def baseline() -> Run:
    return failure_free()


def kill(step: int, replica: int, phase: str) -> pb.FaultSpec:
    return pb.FaultSpec(step=step, replica=replica, phase=phase, microbatch=-1)


def assert_survivors_match(run: Run, baseline: Run, lost: list[int]) -> None:
    assert run.controller.lost == lost
    survivors = [r for r in range(REPLICAS) if r not in lost]
    assert all(isinstance(run.controller.ended[r], pb.Shutdown) for r in survivors)
    assert all(run.controller.ended[r] == "killed" for r in lost)
    expected = baseline.params(0)
    for replica in survivors:
        got = run.params(replica)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), \
            f"replica {replica}'s parameters differ from the failure-free run"
        for step in range(STEPS):  # and after every step, not only at the end
            assert run.controller.digests[step][replica] == baseline.controller.digests[step][0]


@pytest.mark.parametrize("phase", ["forward", "backward", "commit"])
def test_a_replica_lost_mid_step_changes_nothing_the_survivors_learn(baseline: Run,
                                                                      phase: str) -> None:
    run = train(faults=(kill(1, 1, phase),), hold={1} if phase == "commit" else None)
    assert_survivors_match(run, baseline, lost=[1])
    # Step 1 was finished and committed by the two survivors in the next generation.
    assert run.controller.commits == [(0, 1), (1, 2), (2, 2), (3, 2)]
    assert sorted(run.rendezvous.worlds) == [1, 2]
    assert run.rendezvous.worlds[1].broken is not None


def test_a_replica_lost_inside_the_reduce_leaves_no_trace(baseline: Run) -> None:
    # Replica 1 (rank 1) dies in its second allreduce (step 1's) after contributing its
    # buffer; whoever was waiting is left with a partially reduced buffer.
    run = train(crash_in_allreduce=(1, 1))
    assert_survivors_match(run, baseline, lost=[1])
    assert run.controller.commits == [(0, 1), (1, 2), (2, 2), (3, 2)]
    assert "died in allreduce 1" in (run.rendezvous.worlds[1].broken or "")


def test_two_losses_in_one_step_leave_one_replica_to_finish_it(baseline: Run) -> None:
    # Replica 1 dies in a forward pass; replica 2 then dies computing one of its microbatches.
    run = train(faults=(kill(2, 1, "forward"), kill(2, 2, "recompute")))
    assert_survivors_match(run, baseline, lost=[1, 2])
    assert run.controller.commits == [(0, 1), (1, 1), (2, 3), (3, 3)]
    assert run.rendezvous.worlds[3].world_size == 1


def test_fast_mode_recovers_within_rounding(baseline: Run) -> None:
    clean, failed = train(reduce="fast"), train(reduce="fast", faults=(kill(1, 2, "backward"),))
    assert failed.controller.lost == [2]
    survivors = [torch.cat([p.flatten() for p in failed.params(r)]) for r in (0, 1)]
    assert torch.equal(survivors[0], survivors[1])  # one reduced sum, applied by both
    reference = torch.cat([p.flatten() for p in clean.params(0)])
    torch.testing.assert_close(survivors[0], reference, rtol=1e-4, atol=1e-6)


def test_a_slowed_replica_reports_its_sleep_as_compute_and_learns_the_same(baseline: Run) -> None:
    # Replica 1 is 3x slower in steps 1 and 2 (--slowdown): each of its microbatches there
    # sleeps twice its compute, and that sleep is part of the compute_s it reports (what
    # the controller measures replica speed from). Nothing computed changes.
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        time.sleep(seconds)

    slow = pb.SlowdownSpec(replica=1, factor=3.0, from_step=1, until_step=3)
    run = train(slowdowns=(slow,), sleep=sleep)
    assert_survivors_match(run, baseline, lost=[])
    per_step = M // REPLICAS
    assert len(slept) == 2 * per_step  # only replica 1, only steps 1 and 2
    for i, step in enumerate((1, 2)):
        assert run.controller.compute_s[(step, 1)] >= sum(slept[i * per_step:(i + 1) * per_step])


@pytest.mark.parametrize("phase", ["forward", "commit"])
def test_step_digests_hashed_on_a_thread_are_the_same_and_in_order(baseline: Run,
                                                                     phase: str) -> None:
    # Each step's digest is hashed on a thread while the next step computes, the host
    # parameters in place (trainer/stepdigest.py), and reported later. The reports are the
    # in-line ones, step by step, through a loss; none is missing.
    run = train(faults=(kill(1, 1, phase),), hold={1} if phase == "commit" else None)
    assert_survivors_match(run, baseline, lost=[1])
    assert all(executor._digests is not None and executor._digests.borrowing
               for r, executor in run.executors.items() if r != 1)
    # Those hashed by the next step's reduction came inside its `reduced` report (one message
    # fewer; how many depends on the hashing thread's timing: none on a saturated machine,
    # test_a_digest_done_before_the_next_reduction_rides_on_it), the rest alone when a worker
    # waited for a command. None is missing (assert_survivors_match); in line, none folds.
    assert baseline.controller.folded == 0
    for replica in (0, 2):
        ledger = run.executors[replica].ledger  # one record per step, each with its digest
        assert len(ledger) == STEPS and [d.param_sha256 for r in ledger for d in r.param_sha256
                if d.replica == replica] == [baseline.controller.digests[s][0]
                                             for s in range(STEPS)]


def test_a_digest_done_before_the_next_reduction_rides_on_it(
        baseline: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    # Made deterministic: each digest is awaited where a worker only collects the finished
    # ones, so every step's but the last is done by the next step's reduction and folded.
    from recover.trainer import stepdigest

    deliver = stepdigest.BackgroundDigests.deliver
    monkeypatch.setattr(stepdigest.BackgroundDigests, "deliver",
                        lambda self, wait=False: deliver(self, wait=True))
    run = train()
    assert_survivors_match(run, baseline, lost=[])
    assert run.controller.folded == REPLICAS * (STEPS - 1)


def test_with_a_callback_after_the_commit_the_digest_hashes_copies(
        baseline: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    # on_step_committed is user code that may write the parameters while the digest of the
    # step hashes them: with one, the parameters are copied first (without: hashed in place).
    from recover.trainer import stepdigest

    borrow_asked: list[bool] = []
    submit = stepdigest.BackgroundDigests.submit

    def recorded(self: Any, *args: Any, borrow: bool = True) -> None:
        borrow_asked.append(borrow)
        submit(self, *args, borrow=borrow)

    monkeypatch.setattr(stepdigest.BackgroundDigests, "submit", recorded)
    committed: list[int] = []

    def with_callback(executors: dict[int, StepExecutor]) -> None:
        for executor in executors.values():
            executor.workload.on_step_committed = lambda info: committed.append(info.step)

    run = train(prepare=with_callback)
    assert_survivors_match(run, baseline, lost=[])
    assert len(committed) == REPLICAS * STEPS
    assert len(borrow_asked) == REPLICAS * (STEPS - 1) and not any(borrow_asked)  # final: in line
    borrow_asked.clear()
    train()
    assert len(borrow_asked) == REPLICAS * (STEPS - 1) and all(borrow_asked)


def samples(workers: int) -> Any:
    """A dataset source (4 samples per microbatch), loading ahead on `workers` threads."""
    from torch.utils.data import TensorDataset

    from recover.trainer.sources import DatasetMicrobatches

    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(3))
    return DatasetMicrobatches(TensorDataset(x, x.sum(1, keepdim=True).sin()), 4,
                               num_workers=workers, prefetch=3)


def test_batches_loaded_ahead_train_the_same_through_a_loss() -> None:
    # Each replica's planned microbatches are loaded by its loader threads; a loss moves
    # microbatches (dropping what was loaded for them); the survivors end bitwise where
    # replicas loading in line do.
    inline = train(source_of=lambda: samples(0))
    ahead = train(faults=(kill(1, 1, "forward"),), source_of=lambda: samples(2))
    assert_survivors_match(ahead, inline, lost=[1])
    loaders = {thread for r in (0, 2)
               for _, thread in ahead.executors[r].workload.source.prefetcher.loaded_by}
    assert any(name.startswith("recover-loader") for name in loaders), loaders
