"""The user's training pieces, checked once, and how one microbatch and one commit use them.

The executor (executor.py) decides *which* microbatch to compute and *when*
to apply a step; this module does the computing and the applying, so the
executor knows no model and this module knows no generations.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from recover.trainer.buffers import ModelBuffers, model_buffers
from recover.trainer.digest import legacy_step_digest, step_digest
from recover.trainer.errors import call_user, contract_error
from recover.trainer.gradients import GradientBuckets
from recover.trainer.lossscale import LossScaler
from recover.trainer.sampling import microbatch_seed
from recover.trainer.sources import MicrobatchSource

LossFn = Callable[[torch.nn.Module, Any], Any]
"""(model, batch) -> scalar loss tensor, or (loss, tokens): ReCoVer calls backward."""
ForwardBackwardFn = Callable[[torch.nn.Module, Any], Any]
"""(model, batch) -> scalar loss (tensor or float), or (loss, tokens); runs its own backward."""


@runtime_checkable
class Stateful(Protocol):
    """Anything with `state_dict()` and `load_state_dict()`: extra state that must survive
    a join or a restore (a data-loader position, an EMA of the weights, a step counter)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class StepInfo:
    """What `on_step_committed` learns about a step every replica has just applied."""

    step: int
    """The step, from 0; committed steps so far = step + 1."""
    loss: float
    """Mean loss over the step's M microbatches (the same on every replica)."""
    lr: float
    """Learning rate of the optimizer's first parameter group for this step."""
    grad_norm: float | None
    """Global norm of the reduced gradient before clipping (None without max_grad_norm)."""
    microbatches: int
    """Microbatches the step summed: M, whatever failed."""
    tokens: int
    """Tokens the step's microbatches reported (0 when the loss function reports none)."""
    generation: int
    """Membership generation the step committed in."""
    replica: int
    """This replica."""
    is_first_replica: bool
    """True on exactly one live replica: log, evaluate or write files there only."""
    loss_scale: float | None = None
    """With `loss_scale=`: the scale this step's backward used (None without loss scaling)."""
    skipped: bool = False
    """With `loss_scale=`: the step's reduced gradient was not finite, so the optimizer did
    not step (the scale backed off). Every replica skips the same steps."""


@dataclass(frozen=True)
class AppliedStep:
    """What applying a committed step did."""

    lr: float
    """The learning rate of the optimizer's first parameter group."""
    grad_norm: float | None
    """The reduced gradient's global norm before clipping (None without max_grad_norm)."""
    loss_scale: float | None = None
    """The loss scale the step's backward used (None without loss scaling)."""
    skipped: bool = False
    """The optimizer did not step: the reduced gradient was not finite."""
    loss_scale_factor: float = 1.0
    """What the next step's loss scale is, relative to this step's."""


@dataclass
class MicrobatchResult:
    loss: float
    tokens: int
    sample_ids: list[int]


@dataclass
class Workload:
    """The user's pieces (validated by `recover.trainer.api.train`)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    source: MicrobatchSource
    seed: int
    loss_fn: LossFn | None = None
    forward_backward: ForwardBackwardFn | None = None
    lr_scheduler: Any = None
    max_grad_norm: float | None = None
    on_step_committed: Callable[[StepInfo], None] | None = None
    extra_state: Mapping[str, Stateful] = field(default_factory=dict)
    buffers: str = "reduce"
    """The model's buffers: "reduce" (inside the guarantee, buffers.py) or "local"."""
    split_batch: Callable[[Any], Any] | None = None
    """A replica of several ranks: a microbatch -> this rank's slice of it (replica.py)."""
    combine_digest: Callable[[str], str] | None = None
    """A replica of several ranks: this rank's digest -> the replica's (a collective)."""
    reshard_state: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    """A sharded model: a received or loaded state (this rank's shards as plain tensors)
    -> the same with DTensors where the model's own state has them (sharding.py)."""
    gradient_sync: Callable[[bool], None] | None = None
    """FSDP2 in fast mode: told before each microbatch whether it is the last of the step
    (as planned so far), so the shards are reduce-scattered once per step (sharding.py)."""
    loss_scaler: LossScaler | None = None
    """Dynamic loss scaling (float16 autocast; lossscale.py); None: the loss as it is."""
    determinism_hint: str = ""
    """A likely cause of a failed determinism check that only this setup has (a pipeline
    stage with buffers: sharding.py), added to the check's message."""
    params: list[torch.nn.Parameter] = field(init=False)
    model_buffers: ModelBuffers | None = field(init=False)
    """The buffers reduced with each step; None when there are none (or "local")."""
    buffer_warning: str | None = field(init=False)
    """One line naming buffers the mode leaves outside the guarantee, to log at start."""
    _computing: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        trainable = {id(p) for p in self.params}
        optimized = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        if trainable - optimized:
            raise contract_error(f"{len(trainable - optimized)} trainable parameter(s) of the "
                                 "model are not in the optimizer (pass model.parameters() to it, "
                                 "or set requires_grad=False on frozen ones)", where="train")
        if optimized - trainable:
            # Their gradients would never be reduced: every replica would step its own.
            raise contract_error(f"the optimizer holds {len(optimized - trainable)} parameter(s) "
                                 "that are not trainable parameters of the model; make them part "
                                 "of the model (an nn.Parameter attribute of a module)",
                                 where="train")
        try:
            self.model_buffers, self.buffer_warning = model_buffers(self.model, self.buffers)
        except ValueError as exc:
            raise contract_error(f"train(): {exc}", where="train") from None
        for owner, name in ((self.optimizer, "optimizer"), (self.model, "model")):
            owner.zero_grad = self._guard_zero_grad(owner.zero_grad, name)  # type: ignore[method-assign]

    def _guard_zero_grad(self, zero_grad: Callable[..., None], owner: str) -> Callable[..., None]:
        """zero_grad() inside a microbatch would drop what the step accumulated so far
        (ReCoVer sums microbatches in `.grad` and zeroes it itself): refuse it there."""

        def guarded(*args: Any, **kwargs: Any) -> None:
            if self._computing:
                raise contract_error(f"{owner}.zero_grad() was called while computing a "
                                     "microbatch: ReCoVer sums a step's microbatches in .grad and "
                                     "zeroes it itself; remove the call", where="zero_grad")
            zero_grad(*args, **kwargs)

        return guarded

    # ------------------------------------------------------------ one microbatch

    def seed_rngs(self, step: int, microbatch: int) -> None:
        """Seed torch's default generators from (seed, step, microbatch): dropout and any
        torch.rand without a generator then draw the same numbers whoever computes it."""
        seed = microbatch_seed(self.seed, step, microbatch, "dropout")
        # The CPU generator (and the current GPU's when CUDA is in use) only:
        # torch.manual_seed also seeds every accelerator backend, ~0.75 ms per call.
        torch.default_generator.manual_seed(seed)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.manual_seed(seed)

    def compute(self, step: int, microbatch: int,
                before_backward: Callable[[], None] | None = None,
                last: bool = True) -> MicrobatchResult:
        """Forward and backward of one microbatch, its gradient added into `.grad`; `last`:
        no other microbatch of the step is planned after it (so far)."""
        if self.gradient_sync is not None:
            self.gradient_sync(last)
        self._computing = True
        try:
            result = self._compute(step, microbatch, before_backward)
            if self.model_buffers is not None:
                # Its buffer update into the step's sum; the model holds the committed buffers
                # again, so the next forward, whichever microbatch, starts from them too.
                self.model_buffers.capture()
            return result
        finally:
            self._computing = False

    def _compute(self, step: int, microbatch: int,
                 before_backward: Callable[[], None] | None) -> MicrobatchResult:
        ids = list(call_user("microbatches.sample_ids", self.source.sample_ids, step, microbatch,
                             step=step, microbatch=microbatch))
        self.seed_rngs(step, microbatch)
        batch = call_user("microbatches", self.source.batch, step, microbatch,
                          step=step, microbatch=microbatch)
        if self.split_batch is not None:
            try:
                batch = self.split_batch(batch)
            except ValueError as exc:
                raise contract_error(str(exc), where="microbatches", step=step,
                                     microbatch=microbatch) from None
        if self.forward_backward is not None:
            if before_backward is not None:
                before_backward()
            out = call_user("forward_backward", self.forward_backward, self.model, batch,
                            step=step, microbatch=microbatch)
            loss, tokens = self._unpack(out, "forward_backward", step, microbatch, own_backward=True)
        else:
            assert self.loss_fn is not None
            out = call_user("loss_fn", self.loss_fn, self.model, batch,
                            step=step, microbatch=microbatch)
            loss, tokens = self._unpack(out, "loss_fn", step, microbatch, own_backward=False)
            if before_backward is not None:
                before_backward()
            scaled = loss if self.loss_scaler is None else loss * self.loss_scaler.scale
            call_user("loss_fn (backward)", scaled.backward, step=step, microbatch=microbatch)
        return MicrobatchResult(float(loss.detach()) if isinstance(loss, torch.Tensor) else loss,
                                tokens, ids)

    def _unpack(self, out: Any, where: str, step: int, microbatch: int,
                own_backward: bool) -> tuple[Any, int]:
        """Check what the user's function returned: a scalar loss, optionally with a token count."""
        loss, tokens = out, 0
        if isinstance(out, tuple):
            if len(out) != 2:
                raise contract_error(f"{where} returned a tuple of {len(out)}; return the loss, "
                                     "or (loss, tokens)", where=where, step=step,
                                     microbatch=microbatch)
            loss, tokens = out
            if isinstance(tokens, torch.Tensor) and tokens.numel() == 1:
                tokens = int(tokens.item())
            if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
                raise contract_error(f"{where} returned tokens={tokens!r}; the token count must "
                                     "be a whole number >= 0", where=where, step=step,
                                     microbatch=microbatch)
        if own_backward and isinstance(loss, int | float) and not isinstance(loss, bool):
            return float(loss), tokens
        if not isinstance(loss, torch.Tensor):
            raise contract_error(f"{where} returned {type(loss).__name__}; it must return the loss "
                                 "as a scalar tensor", where=where, step=step, microbatch=microbatch)
        if loss.numel() != 1:
            raise contract_error(f"{where} returned a loss of shape {list(loss.shape)}; it must be "
                                 "a scalar (reduce it, e.g. with .mean())", where=where, step=step,
                                 microbatch=microbatch)
        if not loss.is_floating_point():
            raise contract_error(f"{where} returned a {loss.dtype} loss; it must be a floating "
                                 "point scalar", where=where, step=step, microbatch=microbatch)
        if not own_backward and not loss.requires_grad:
            raise contract_error(f"{where} returned a loss that does not require grad: it was "
                                 "computed without the model's parameters, or under "
                                 "torch.no_grad()", where=where, step=step, microbatch=microbatch)
        return loss.reshape(()) if not own_backward else float(loss.detach()), tokens

    # ------------------------------------------------------------ one commit

    def apply(self, grads: GradientBuckets, means: list[torch.Tensor]) -> AppliedStep:
        """Apply a committed step's reduced gradient (and, after it in `means`, the mean update
        of the buffers in the guarantee). `means` are left as they are (joiners get them)."""
        count = len(grads.buckets)
        grads.load(means[:count])
        if self.model_buffers is not None:
            self.model_buffers.commit(means[count:])
        lr = float(self.optimizer.param_groups[0].get("lr", math.nan))
        scale, skip, factor = None, False, 1.0
        if self.loss_scaler is not None:
            # Decided from the reduced gradient, the same on every replica: so is the skip.
            scale = self.loss_scaler.scale
            finite = all(bool(torch.isfinite(mean).all()) for mean in means[:count])
            skip = self.loss_scaler.commit(finite).skip
            factor = self.loss_scaler.scale / scale
            if not skip:
                for bucket in grads.buckets:  # exact for a power of two (the defaults)
                    bucket.flat.mul_(1.0 / scale)
        norm = None
        if self.max_grad_norm is not None and not skip:
            # The reduced gradient is the same on every replica, so is its norm and the clip.
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
        if not skip:
            call_user("optimizer.step", self.optimizer.step)
        if self.lr_scheduler is not None:  # per committed step, as after GradScaler.step
            call_user("lr_scheduler.step", self.lr_scheduler.step)
        return AppliedStep(lr, norm, scale, skip, factor)

    def restore_buffers(self) -> None:
        """After user code ran outside a microbatch (on_step_committed, an eval in train mode):
        the model holds the committed buffers again, so what a donor snapshots is committed."""
        if self.model_buffers is not None:
            self.model_buffers.restore()

    def digest_tensors(self) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
        """What the step digest covers, named: the parameters, and the buffers in the
        guarantee (as `digest` hashes them)."""
        return (list(self.model.named_parameters()),
                list(self.model_buffers.named()) if self.model_buffers else [])

    def digest(self, legacy: bool = False, pool: Executor | None = None) -> str:
        """The step digest: parameters, and the buffers in the guarantee (digest.step_digest;
        `legacy`: as builds before digest.DIGEST_SCHEME made it; `pool`: threads to hash
        the chunks on, the same digest)."""
        digest = (step_digest(*self.digest_tensors(), pool=pool) if not legacy
                  else legacy_step_digest(*self.digest_tensors()))
        return self.combine_digest(digest) if self.combine_digest is not None else digest

    # ------------------------------------------------------------ state for joins and restores

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"model": self.model.state_dict(),
                                 "optimizer": self.optimizer.state_dict()}
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        state["extra"] = {name: call_user(f"extra_state[{name!r}].state_dict", obj.state_dict)
                          for name, obj in self.extra_state.items()}
        if self.loss_scaler is not None:
            state["loss_scale"] = self.loss_scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.reshard_state is not None:
            state = self.reshard_state(state)
        self.model.load_state_dict(state["model"])
        if self.model_buffers is not None:
            self.model_buffers.recommit()  # a donor's or a checkpoint's committed buffers
        self.optimizer.load_state_dict(state["optimizer"])
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        for name, obj in self.extra_state.items():
            call_user(f"extra_state[{name!r}].load_state_dict", obj.load_state_dict,
                      state["extra"][name])
        if self.loss_scaler is not None and "loss_scale" in state:
            self.loss_scaler.load_state_dict(state["loss_scale"])
