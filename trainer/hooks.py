"""Named points of a step where test concerns act, kept out of the executor's code.

Fault injection (`--kill`), emulated accelerator time (`--compute-ms`) and slowed replicas
(`--slowdown`) are what the tests and benchmarks need from inside a step; production needs
none of them. So the executor calls these methods at fixed points and knows nothing of what
they do: `StepHooks` (the default) does nothing, `faults.FaultHooks` fires the job's faults
and sleeps the emulated compute and the slowdown, and a unit test may hand in its own.
Each method is named for *where* in the step it is called, so one phase of the fault
injector maps to one point.

Torch-free on purpose: the command-line tools import the fault specs (faults.py), which
build on this.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recover.trainer.gradients import GradientBuckets


class MicrobatchPoints:
    """The points inside one microbatch's computation; none act here."""

    def before_backward(self) -> None:
        """After the forward pass (the loss is computed), before its backward."""

    def after_backward(self) -> None:
        """After the backward pass: undo anything `before_backward` set up."""


NO_POINTS = MicrobatchPoints()


class StepHooks:
    """Where a step may be acted upon from outside; every point is a no-op here.

    Called on the training thread unless a method says otherwise. `step` is the step the
    replica is at; `position` counts the microbatches this replica has accumulated in the
    step and `count` is its share of the step's first plan (what a fault's microbatch
    position refers to).
    """

    def on_startup(self, step: int) -> None:
        """Attached to the agent and built, before reporting ready."""

    def on_rebuild(self, step: int) -> None:
        """A recovery: the new generation's group is installed, about to connect."""

    def before_microbatch(self, step: int, position: int, count: int, *, recomputed: bool,
                          params: Sequence[Any]) -> MicrobatchPoints:
        """About to compute a microbatch (`recomputed`: it was reassigned from a lost
        replica); returns the points inside it. `params` are the trainable parameters."""
        return NO_POINTS

    def after_microbatch(self, step: int, position: int, count: int,
                         grads: GradientBuckets) -> None:
        """Its gradient is in `grads`, not yet accumulated into the step's sum."""

    def on_share_grown(self, step: int) -> None:
        """Work-stealing: microbatches stolen for this replica were added to its share."""

    def on_release(self, step: int) -> None:
        """Work-stealing: this replica answered a Release, giving microbatches away."""

    def before_reduce(self, step: int) -> None:
        """About to reduce the step's buffers (copies of the accumulation)."""

    def after_reported(self, step: int) -> None:
        """The reduction is reported to the controller; its commit has not come yet."""

    def after_snapshot_sent(self, step: int) -> None:
        """A donor has sent its snapshot of `step` to a joiner (on the donation's thread)."""

    def before_feeding(self, step: int) -> None:
        """A donor got the commit of `step` that admits its joiner (the next generation
        follows it), before applying it and so before streaming it to the joiner."""

    def after_snapshot_loaded(self, step: int) -> None:
        """A joiner has loaded its donor's snapshot of `step`, before catching up."""
