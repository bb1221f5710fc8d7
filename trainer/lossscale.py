"""Dynamic loss scaling for float16 autocast: the role `torch.amp.GradScaler` plays in a
plain loop, inside ReCoVer's guarantee.

A GradScaler decides from the gradient *its* process computed whether to skip the step and
how to change the scale. Under ReCoVer the step's gradient is the reduced one, the same on
every replica (bitwise in exact mode), so the decision is made from that: a step whose
reduced gradient is not finite is skipped on every replica and the scale backs off; after
`growth_interval` finite steps in a row it grows. The scale and the count of finite steps
are training state (joins and checkpoints carry them), so a replica that joins, or a resumed
job, scales exactly as the failure-free run does.

Scales are powers of two (with the default factors), so scaling the loss and unscaling the
reduced gradient are exact: a run with loss scaling and no overflow computes the same
parameters as one without it, up to the float16 forward itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LossScale:
    """How the loss scale starts and changes (torch.amp.GradScaler's defaults)."""

    init_scale: float = 2.0 ** 16
    """The scale of the first step."""
    growth_factor: float = 2.0
    """The scale is multiplied by this after `growth_interval` finite steps in a row."""
    backoff_factor: float = 0.5
    """The scale is multiplied by this after a step whose reduced gradient was not finite."""
    growth_interval: int = 2000
    """Finite steps in a row before the scale grows."""

    def check(self) -> str | None:
        """Why this configuration cannot be used (one line), or None."""
        if not (math.isfinite(self.init_scale) and self.init_scale > 0):
            return f"init_scale must be a positive number, got {self.init_scale}"
        if not (math.isfinite(self.growth_factor) and self.growth_factor > 1):
            return f"growth_factor must be above 1, got {self.growth_factor}"
        if not 0 < self.backoff_factor < 1:
            return f"backoff_factor must be between 0 and 1, got {self.backoff_factor}"
        if self.growth_interval < 1:
            return f"growth_interval must be at least 1, got {self.growth_interval}"
        return None


@dataclass(frozen=True)
class ScaleState:
    """The loss scale of the next step and how many finite steps led to it."""

    scale: float
    """What the next step's loss is multiplied by."""
    finite_steps: int = 0
    """Finite steps since the scale last changed."""


@dataclass(frozen=True)
class ScaleDecision:
    state: ScaleState
    """The state for the next step."""
    skip: bool
    """Skip this step's optimizer update (its gradient was not finite)."""
    reason: str
    """Why, in one line (for a log)."""


def next_scale(config: LossScale, state: ScaleState, finite: bool) -> ScaleDecision:
    """What a committed step whose reduced gradient was (not) finite does to the scale."""
    if not finite:
        scale = state.scale * config.backoff_factor
        return ScaleDecision(ScaleState(scale), True,
                             f"gradient not finite at scale {state.scale:g}: step skipped, "
                             f"scale {scale:g}")
    finite_steps = state.finite_steps + 1
    if finite_steps >= config.growth_interval:
        scale = state.scale * config.growth_factor
        return ScaleDecision(ScaleState(scale), False,
                             f"{finite_steps} finite steps at scale {state.scale:g}: scale {scale:g}")
    return ScaleDecision(ScaleState(state.scale, finite_steps), False,
                         f"finite at scale {state.scale:g} ({finite_steps} of "
                         f"{config.growth_interval} before it grows)")


class LossScaler:
    """The scale a replica's microbatches use now, and its update at every commit."""

    def __init__(self, config: LossScale) -> None:
        self.config = config
        self.state = ScaleState(config.init_scale)
        self.skipped_steps = 0
        """Steps skipped so far (for the user's logs; not state: a joiner counts from 0)."""

    @property
    def scale(self) -> float:
        return self.state.scale

    def commit(self, finite: bool) -> ScaleDecision:
        decision = next_scale(self.config, self.state, finite)
        self.state = decision.state
        self.skipped_steps += decision.skip
        return decision

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.state.scale, "finite_steps": self.state.finite_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = ScaleState(float(state["scale"]), int(state["finite_steps"]))


def make_scaler(loss_scale: Any, model: torch.nn.Module, *, has_loss_fn: bool,
                sharded: bool) -> LossScaler:
    """The scaler `train(loss_scale=...)` asks for; ValueError (one line) when it cannot be."""
    if not isinstance(loss_scale, LossScale):
        raise ValueError(f"pass rt.LossScale(...), got {type(loss_scale).__name__}")
    if (problem := loss_scale.check()) is not None:
        raise ValueError(problem)
    if not has_loss_fn:
        raise ValueError("needs loss_fn (ReCoVer scales the loss before it calls backward); a "
                         "forward_backward function runs its own backward")
    if sharded:
        raise ValueError("not supported with several ranks per replica yet (each rank sees "
                         "only its shard of the gradient, and all must skip the same steps)")
    narrow = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()
                     if p.requires_grad and p.dtype not in (torch.float32, torch.float64)})
    if narrow:
        raise ValueError(f"the model has {', '.join(narrow)} parameters: keep them float32 and "
                         "run the forward in float16 under torch.autocast (a float16 gradient "
                         "cannot be unscaled without losing its small values)")
    return LossScaler(loss_scale)
