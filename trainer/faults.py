"""Built-in fault injection: a worker SIGKILLs itself at a chosen point.

A spec reads `step=20,replica=1,phase=backward[,microbatch=K]`. The kill is a
real SIGKILL of the worker's own process: nothing is cleaned up, sockets are
dropped by the kernel, exactly as with a crash. Just before it, the worker
notes the fault to its agent (bounded, best effort) so the failure record can
say where it happened; recovery never depends on that note.

The executor never calls this module: `hooks_for` turns the job's testing
config into the `StepHooks` it is handed (hooks.py), a no-op unless the job
injects faults into this replica, emulates compute or slows this replica
(`--slowdown`, slowdown.py).
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from recover.proto import pb
from recover.trainer.hooks import MicrobatchPoints, StepHooks
from recover.trainer.slowdown import SlowdownSchedule

if TYPE_CHECKING:
    from recover.trainer.gradients import GradientBuckets

PHASES: dict[str, str] = {
    "forward": "after the forward pass of a microbatch, before its backward",
    "backward": "inside the backward pass of a microbatch (from a gradient hook)",
    "reduce": "while the gradient allreduce is in flight",
    "commit": "after reporting the reduction, before the controller's commit arrives",
    "rebuild": "while rebuilding the process group of a new generation (a recovery)",
    "recompute": "while computing a microbatch reassigned from a lost replica",
    "stop": "hang: SIGSTOP itself while computing a microbatch (for the watchdog)",
    "spin": "hang: loop forever in Python while computing a microbatch (for the watchdog)",
    "deadlock": "hang: block forever on a lock while computing a microbatch (for the watchdog)",
    "slow": "stay alive but sleep `seconds` in every microbatch of the step (must NOT be killed)",
    "nan": "not a kill: poison one microbatch's gradient with NaN in every attempt of the step",
    "steal": "work-stealing: right after being handed stolen microbatches, before computing them",
    "release": "work-stealing: right after answering a Release that gave microbatches away",
    "startup": "while starting: after attaching to its agent, before reporting ready",
    "join": "while joining: right after loading a donor's snapshot, before catching up",
    "donate": "while donating: right after sending the snapshot to a joiner (mid-stream)",
    "feed": "while donating: at the commit that admits its joiner, before streaming that step",
}
HANG_PHASES = ("stop", "spin", "deadlock")
ANY_REPLICA_PHASES = ("join", "donate", "startup")
"""Phases that may target a replica started later (a restart's new id: replicas, replicas+1...)."""
AT_OR_AFTER_PHASES = ("join", "donate", "feed", "steal", "release")
"""Phases whose step means "the first time at or after it" (joins happen when they happen)."""


class FaultSpecError(ValueError):
    """A --kill spec that cannot be understood; the message says what is wrong."""


def parse_fault_spec(text: str) -> pb.FaultSpec:
    """Parse `step=S,replica=R,phase=P[,microbatch=K][,seconds=X][,rank=N]`."""
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or not key or not value:
            raise FaultSpecError(f"malformed --kill {text!r}: expected key=value pairs such as "
                                 "step=20,replica=1,phase=backward")
        if key in fields:
            raise FaultSpecError(f"malformed --kill {text!r}: {key!r} given twice")
        fields[key] = value
    unknown = set(fields) - {"step", "replica", "phase", "microbatch", "seconds", "rank"}
    if unknown:
        raise FaultSpecError(f"malformed --kill {text!r}: unknown key(s) {sorted(unknown)}")
    missing = {"step", "replica", "phase"} - set(fields)
    if missing:
        raise FaultSpecError(f"malformed --kill {text!r}: missing {sorted(missing)}")
    if fields["phase"] not in PHASES:
        raise FaultSpecError(f"malformed --kill {text!r}: phase must be one of {', '.join(PHASES)}")
    try:
        step, replica = int(fields["step"]), int(fields["replica"])
        microbatch = int(fields.get("microbatch", "-1"))
        rank = int(fields.get("rank", "0"))
        seconds = float(fields.get("seconds", "1.0" if fields["phase"] == "slow" else "0"))
    except ValueError:
        raise FaultSpecError(f"malformed --kill {text!r}: step, replica, microbatch and "
                             "rank must be integers, seconds a number") from None
    if step < 0 or replica < 0 or microbatch < -1 or rank < 0:
        raise FaultSpecError(f"malformed --kill {text!r}: values must not be negative")
    if not 0 <= seconds < 3600:  # also refuses nan and inf
        raise FaultSpecError(f"malformed --kill {text!r}: seconds must be in [0, 3600)")
    if "seconds" in fields and fields["phase"] != "slow":
        raise FaultSpecError(f"malformed --kill {text!r}: seconds= goes with phase=slow only")
    return pb.FaultSpec(step=step, replica=replica, phase=fields["phase"], microbatch=microbatch,
                        seconds=seconds, rank=rank)


def format_fault_spec(spec: pb.FaultSpec) -> str:
    text = f"step={spec.step},replica={spec.replica},phase={spec.phase}"
    if spec.phase == "slow":
        text += f",seconds={spec.seconds!r}"
    text += f",microbatch={spec.microbatch}" if spec.microbatch >= 0 else ""
    return text + (f",rank={spec.rank}" if spec.rank else "")


def _sigkill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class FaultInjector:
    """Fires this replica's faults; `note` tells the agent first. `kill` is how the
    process dies (SIGKILL; an in-process test may end a thread instead)."""

    def __init__(self, faults: Iterable[pb.FaultSpec], replica: int,
                 note: Callable[[pb.FaultNote], None],
                 stamp: Callable[[], None] | None = None,
                 kill: Callable[[], None] = _sigkill_self, rank: int = 0) -> None:
        self._faults = [f for f in faults if f.replica == replica and f.rank == rank]
        self._note = note
        self._stamp = stamp
        self._kill = kill

    @property
    def has_faults(self) -> bool:
        """Whether any fault targets this replica."""
        return bool(self._faults)

    def _kill_now(self) -> None:
        if self._stamp is not None:
            self._stamp()
        self._kill()

    def armed(self, step: int, phase: str, position: int | None = None,
              count: int | None = None) -> bool:
        """Whether a fault targets (step, phase) and, for per-microbatch phases, this position."""
        for fault in self._faults:
            if fault.phase != phase or (fault.step > step if phase in AT_OR_AFTER_PHASES
                                        else fault.step != step):
                continue
            if position is None:
                return True
            target = fault.microbatch if fault.microbatch >= 0 else (count or 1) // 2
            if position == min(target, max((count or 1) - 1, 0)):
                return True
        return False

    def fire(self, step: int, phase: str) -> None:
        """Kill this process now, the hard way."""
        # The note travels first (an RPC of ~2 ms); the kill time is stamped after it.
        self._note(pb.FaultNote(step=step, phase=phase, killed_at=time.time()))
        self._kill_now()

    def slow_seconds(self, step: int) -> float:
        return sum(f.seconds for f in self._faults if f.step == step and f.phase == "slow")

    def hang(self, step: int, phase: str) -> None:
        """Stop making progress without dying; the agent's watchdog must notice."""
        self._note(pb.FaultNote(step=step, phase=phase, killed_at=time.time()))
        if phase == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif phase == "spin":
            while True:
                pass
        elif phase == "deadlock":
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()

    def microbatch_points(self, step: int, position: int, count: int,
                          params: Sequence[Any]) -> MicrobatchFaults:
        return MicrobatchFaults(self, step, position, count, params)

    def fire_soon(self, step: int, phase: str, delay_s: float = 0.002) -> None:
        """Kill from a timer thread, so the main thread is inside a blocking call when it lands."""
        note = pb.FaultNote(step=step, phase=phase, killed_at=time.time() + delay_s)
        self._note(note)
        threading.Timer(delay_s, self._kill_now).start()


class MicrobatchFaults(MicrobatchPoints):
    """The fault points of one microbatch: between its forward and backward (hangs, slow,
    forward), and inside its backward (a gradient hook on a middle parameter)."""

    def __init__(self, injector: FaultInjector, step: int, position: int, count: int,
                 params: Sequence[Any]) -> None:
        self._injector = injector
        self._at = (step, position, count)
        self._params = params
        self._hook: Any = None
        self._sharded = False
        self.slept_s = 0.0
        """What a `phase=slow` fault slept in this microbatch (not compute: not slowed)."""

    def before_backward(self) -> None:
        injector, (step, position, count) = self._injector, self._at
        for phase in HANG_PHASES:
            if injector.armed(step, phase, position, count):
                injector.hang(step, phase)
        if delay := injector.slow_seconds(step):
            time.sleep(delay)
            self.slept_s += delay
        if injector.armed(step, "forward", position, count):
            injector.fire(step, "forward")
        if injector.armed(step, "backward", position, count):
            middle = self._params[len(self._params) // 2]
            self._sharded = hasattr(middle, "to_local")
            if self._sharded:  # FSDP2 shard: autograd never sees its gradient, FSDP calls
                # the post-accumulate hooks once it reduce-scattered it (in a backward)
                self._hook = middle.register_post_accumulate_grad_hook(
                    lambda param: injector.fire(step, "backward"))
            else:
                self._hook = middle.register_hook(lambda grad: injector.fire(step, "backward"))

    def after_backward(self) -> None:
        if self._hook is not None and not self._sharded:
            self._hook.remove()
            self._hook = None
        # A shard's hook stays until FSDP reduce-scatters it: in fast mode, where the
        # replica's microbatches are reduce-scattered together at its last one, the kill
        # lands in that backward, still inside the step.


class FaultHooks(StepHooks):
    """The step hooks of a job whose testing config asks for something: its faults that
    target this replica, each fired at its phase's point, emulated compute, and this
    replica's slowdowns. `clock` and `sleep` are seams for tests (default: real time)."""

    def __init__(self, injector: FaultInjector, compute_ms: float = 0.0,
                 slowdown: SlowdownSchedule | None = None, *,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] | None = None) -> None:
        self.faults = injector
        self.compute_s = max(compute_ms, 0.0) / 1000.0
        self.slowdown = slowdown if slowdown is not None else SlowdownSchedule((), 0)
        self._clock = clock
        self._sleep = sleep if sleep is not None else time.sleep
        # The microbatch in flight when its step is slowed: its factor, start, fault points.
        self._factor = 1.0
        self._started = 0.0
        self._points: MicrobatchFaults | None = None

    def _fire_if_armed(self, step: int, phase: str) -> None:
        if self.faults.armed(step, phase):
            self.faults.fire(step, phase)

    def on_startup(self, step: int) -> None:
        self._fire_if_armed(step, "startup")

    def on_rebuild(self, step: int) -> None:
        if self.faults.armed(step, "rebuild"):  # from a timer: it lands inside connect()
            self.faults.fire_soon(step, "rebuild")

    def before_microbatch(self, step: int, position: int, count: int, *, recomputed: bool,
                          params: Sequence[Any]) -> MicrobatchPoints:
        if recomputed:
            self._fire_if_armed(step, "recompute")
        points = self.faults.microbatch_points(step, position, count, params)
        self._factor = self.slowdown.factor_at(step)
        if self._factor > 1.0:
            self._points = points
            self._started = self._clock()
        return points

    def after_microbatch(self, step: int, position: int, count: int,
                         grads: GradientBuckets) -> None:
        if self.faults.armed(step, "nan", position, count):
            grads.buckets[0].flat[0] = math.nan
        if self.compute_s > 0:
            # Emulated accelerator time (--compute-ms): a sleep, not CPU work, so each
            # slot's capacity is its own instead of a share of the machine's cores.
            self._sleep(self.compute_s)
        if self._factor > 1.0:
            # --slowdown: this microbatch's compute (real and emulated, not a slow fault's
            # sleep) took `took`; take factor times that in all. The executor counts this
            # sleep in the step's compute_s, as it would a slower accelerator's time.
            slept = self._points.slept_s if self._points is not None else 0.0
            took = max(self._clock() - self._started - slept, 0.0)
            factor, self._factor, self._points = self._factor, 1.0, None
            if took > 0:
                self._sleep((factor - 1.0) * took)

    def on_share_grown(self, step: int) -> None:
        self._fire_if_armed(step, "steal")

    def on_release(self, step: int) -> None:
        self._fire_if_armed(step, "release")

    def before_reduce(self, step: int) -> None:
        if self.faults.armed(step, "reduce"):  # from a timer: it lands inside the allreduce
            self.faults.fire_soon(step, "reduce")

    def after_reported(self, step: int) -> None:
        self._fire_if_armed(step, "commit")

    def after_snapshot_sent(self, step: int) -> None:
        self._fire_if_armed(step, "donate")

    def before_feeding(self, step: int) -> None:
        self._fire_if_armed(step, "feed")

    def after_snapshot_loaded(self, step: int) -> None:
        self._fire_if_armed(step, "join")


def hooks_for(testing: pb.TestingConfig, replica: int, note: Callable[[pb.FaultNote], None],
              stamp: Callable[[], None] | None = None, rank: int = 0) -> StepHooks:
    """The hooks a replica's executor gets: no-ops unless the job injects faults into this
    replica, emulates compute or slows this replica. `note` tells the agent of a fault,
    `stamp` marks the kill in the progress file."""
    injector = FaultInjector(testing.faults, replica, note, stamp, rank=rank)
    slowdown = SlowdownSchedule(testing.slowdowns, replica)
    if not injector.has_faults and testing.compute_ms <= 0 and not slowdown:
        return StepHooks()
    return FaultHooks(injector, testing.compute_ms, slowdown)
