"""Work-stealing's controller cost over whole steps: the real StealBook (stealing.py's
decisions, stealflow.py's book) driven by simulated members, in virtual time.

    python bench/scripts/stealing_step.py [--sizes 32,256,1024] [--per 4] [--steps 3]

Two ways side by side on the same seeded steps: a decision at every report (as before) and
as the coordinator decides now (only on news that may change a decision, folded once per
pass of its event loop: a decision waits while the previous one's CPU time runs).

Each member computes its share in order (microbatch times drawn per microbatch: about
equal replicas, one in eight 2x slower), reports its progress when that is news (on its
last microbatch, idle, a quarter microbatch off the pace the controller assumes:
common/stealnews.py, as workers do) or, with `--every-microbatch`, after each microbatch
(as workers did before 2026-11-28), reads a Release between microbatches and answers it
with those it had not started (then reports where it is), and takes up a grown share when
idle; every message takes `--latency-ms` / 2 each way. What is measured is the controller's
side only: the progress reports it receives per step, the calls to `StealBook.decide` and
the CPU they took (wall time of the calls, nothing else runs), and the step's virtual
makespan against the ideal M / sum of speeds.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from recover.common.stealnews import worth_reporting  # noqa: E402
from recover.controller.stealflow import StealBook  # noqa: E402
from recover.controller.view import JobView  # noqa: E402
from recover.proto import pb  # noqa: E402

GENERATION, STEP = 1, 1


@dataclass
class Worker:
    """A simulated member, as its worker sees itself."""

    replica: int
    speed: float
    share: list[int]
    slows_to: float = 0.0
    """Its microbatch time once it has done `slow_after` (0: never slows down)."""
    slow_after: int = 0
    done: int = 0
    computing: bool = False
    release: tuple[int, tuple[int, ...]] | None = None
    """A Release read at the next microbatch boundary: (steal number, microbatch ids)."""
    finished_at: float = 0.0
    heard_at: float = 0.0
    """When the controller last heard of it (a report; the step's start)."""
    heard_done: int = 0
    pace: float = 0.1
    """The pace the controller assumes of it: at first the book's uniform 0.1 s."""

    def heard(self, now: float, pace: float = 0.0) -> None:
        self.heard_at, self.heard_done = now, self.done
        self.pace = pace or self.pace


@dataclass
class Step:
    """One simulated step and what the controller spent on it."""

    book: StealBook
    workers: dict[int, Worker]
    rng: random.Random
    half_latency: float
    events: list = field(default_factory=list)
    seq: itertools.count = field(default_factory=itertools.count)
    every_report: bool = False
    """Decide at every valid report, at once (as before 2026-11-27), not as the coordinator
    does now (on news that may change a decision, once per pass of its loop)."""
    every_microbatch: bool = False
    """Members report after every microbatch (before 2026-11-28), not news only."""
    reports: int = 0
    """Progress reports the controller received."""
    decision_due: bool = False
    busy_until: float = 0.0
    """Virtual time the controller is busy deciding until (the decision's measured CPU)."""
    calls: int = 0
    decide_s: float = 0.0
    steals: int = 0
    makespan: float = 0.0
    """When the last member finished, in virtual seconds."""
    ideal: float = 0.0
    """M / the sum of the members' speeds (whole microbatches aside)."""

    def at(self, when: float, action, *args) -> None:
        heapq.heappush(self.events, (when, next(self.seq), action, args))

    def run(self) -> float:
        for worker in self.workers.values():
            self.start_next(worker, 0.0)
        end = 0.0
        while self.events:
            when, _, action, args = heapq.heappop(self.events)
            action(when, *args)
            end = max(end, when)
        assert sorted(mb for w in self.workers.values() for mb in w.share) == \
            list(range(sum(len(w.share) for w in self.workers.values()))), "a microbatch twice"
        return max(w.finished_at for w in self.workers.values())

    # ---------------------------------------------------------------- worker side

    def start_next(self, worker: Worker, now: float) -> None:
        if worker.done < len(worker.share):
            worker.computing = True
            slow = worker.slows_to and worker.done >= worker.slow_after
            took = (worker.slows_to if slow else worker.speed) * self.rng.uniform(0.95, 1.05)
            self.at(now + took, self.microbatch_ended, worker, took)
        else:
            worker.computing = False
            worker.finished_at = now

    def microbatch_ended(self, now: float, worker: Worker, took: float) -> None:
        worker.done += 1
        if self.every_microbatch or worth_reporting(
                left=len(worker.share) - worker.done, elapsed_s=now - worker.heard_at,
                done_since=worker.done - worker.heard_done, pace_s=worker.pace):
            self.report(worker, now, took)
        self.answer_release(worker, now)
        self.start_next(worker, now)

    def report(self, worker: Worker, now: float, took: float) -> None:
        worker.heard(now, took)
        self.at(now + self.half_latency, self.controller_progress, worker.replica,
                tuple(worker.share[:worker.done]), took)

    def answer_release(self, worker: Worker, now: float) -> None:
        if worker.release is None:
            return
        number, asked = worker.release
        worker.release = None
        unstarted = set(worker.share[worker.done:])
        released = tuple(mb for mb in asked if mb in unstarted)
        worker.share = [mb for mb in worker.share if mb not in set(released)]
        self.at(now + self.half_latency, self.controller_released, worker.replica, number,
                released)
        self.report(worker, now, 0.0)  # between two microbatches: where it is, exactly

    def release_arrives(self, now: float, worker: Worker, number: int,
                        ids: tuple[int, ...]) -> None:
        worker.release = (number, ids)
        if not worker.computing:
            self.answer_release(worker, now)

    def share_arrives(self, now: float, worker: Worker, share: tuple[int, ...]) -> None:
        worker.share = list(share)
        if not worker.computing:
            worker.heard(now)  # the controller counts an idle taker's time anew
            self.start_next(worker, now)

    # ------------------------------------------------------------ controller side

    def controller_progress(self, now: float, replica: int, done: tuple[int, ...],
                            took: float) -> None:
        self.reports += 1
        msg = pb.Progress(generation=GENERATION, step=STEP, done=done, last_s=took)
        if self.book.progress(replica, msg, now) or self.every_report:
            self.steer(now)

    def controller_released(self, now: float, replica: int, number: int,
                            ids: tuple[int, ...]) -> None:
        settled = self.book.released(replica, pb.Released(
            generation=GENERATION, step=STEP, steal=number, microbatch_ids=ids), now)
        assert settled is not None
        for taker, taken in settled.takes.items():
            if taken:
                self.at(now + self.half_latency, self.share_arrives, self.workers[taker],
                        self.book.members[taker].share)
        self.steals += bool(settled.microbatch_ids)
        self.steer(now)

    def steer(self, now: float) -> None:
        """As the coordinator does: decisions once per pass of its event loop, so reports
        that come while a decision is being made are folded into the next one."""
        if self.every_report:
            self.decide(now)
        elif not self.decision_due:
            self.decision_due = True
            self.at(max(now, self.busy_until), self.decide)

    def decide(self, now: float) -> None:
        self.decision_due = False
        self.calls += 1
        started = time.perf_counter()
        moves = self.book.decide(now)
        took = time.perf_counter() - started
        self.decide_s += took
        self.busy_until = now + took
        for steal in moves.steals:
            self.at(now + self.half_latency, self.release_arrives, self.workers[steal.giver],
                    steal.number, steal.microbatch_ids)


def one_step(size: int, per: int, seed: int, latency_s: float, every_report: bool,
             slow_after: int = 0, every_microbatch: bool = False) -> Step:
    """One seeded step; one member in eight is 2x slower, from the start or (`slow_after`)
    once it has done that many microbatches."""
    rng = random.Random(seed)
    plan = {r: tuple(range(per * r, per * r + per)) for r in range(size)}
    base = {r: 0.1 * rng.uniform(0.97, 1.03) for r in plan}
    speeds = {r: base[r] * (2.0 if r % 8 == 7 and not slow_after else 1.0) for r in plan}
    book = StealBook(latency_s)
    view = JobView(job=pb.JobConfig(work_stealing=True, global_microbatches=size * per),
                   generation=GENERATION, members=tuple(plan), step=STEP, plan=plan)
    # The controller starts from uniform knowledge: the slow ones are found by their reports.
    book.begin(view, 0.0, {r: 0.1 for r in plan})
    if every_microbatch:  # the first version's model too: an overdue microbatch is a slower pace
        book.members = {r: replace(m, quiet=False) for r, m in book.members.items()}
    workers = {r: Worker(r, speeds[r], list(plan[r]), slows_to=2 * base[r] if r % 8 == 7 and
                         slow_after else 0.0, slow_after=slow_after) for r in plan}
    step = Step(book, workers, rng, latency_s / 2, every_report=every_report,
                every_microbatch=every_microbatch)
    step.makespan = step.run()
    if slow_after:  # the slow ones' first microbatches at full speed
        fast = sum(1 / base[r] for r in plan if r % 8 != 7)
        slow_done = slow_after * base[7]
        step.ideal = slow_done + (size * per - slow_after * size) / (
            fast + sum(1 / (2 * base[r]) for r in plan if r % 8 == 7))
    else:
        step.ideal = size * per / sum(1 / s for s in speeds.values())
    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="32,256,1024")
    parser.add_argument("--per", type=int, default=4, help="microbatches per member")
    parser.add_argument("--steps", type=int, default=3, help="seeded steps per size")
    parser.add_argument("--latency-ms", type=float, default=5.0)
    parser.add_argument("--slow-after", type=int, default=0,
                        help="the slow members slow down only after this many microbatches "
                             "(a replica slowing down mid-step)")
    parser.add_argument("--every-microbatch", action="store_true",
                        help="members report after every microbatch (before 2026-11-28)")
    parser.add_argument("--every-report-up-to", type=int, default=1024,
                        help="also run the old way (a decision at every report) up to this "
                             "size (1,024: ~6 s a step)")
    args = parser.parse_args()
    print("| members | M | decided | reports / step | decisions / step | their CPU / step "
          "| per decision | steals / step | makespan / ideal |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for size in (int(s) for s in args.sizes.split(",")):
        for every_report in (True, False):
            if every_report and size > args.every_report_up_to:
                continue
            steps = [one_step(size, args.per, seed, args.latency_ms / 1000, every_report,
                              args.slow_after, args.every_microbatch)
                     for seed in range(args.steps)]
            calls = statistics.median(s.calls for s in steps)
            cpu = statistics.median(s.decide_s for s in steps)
            print(f"| {size} | {size * args.per} "
                  f"| {'every report' if every_report else 'on news, folded'} "
                  f"| {statistics.median(s.reports for s in steps):.0f} | {calls:.0f} "
                  f"| {cpu * 1000:.1f} ms | {cpu / calls * 1000:.2f} ms "
                  f"| {statistics.median(s.steals for s in steps):.0f} "
                  f"| {statistics.median(s.makespan / s.ideal for s in steps):.3f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
