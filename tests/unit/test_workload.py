"""The user's side of the API, in one process: checks of what the user's functions return,
errors in their code, the determinism check, the commit path and the state that joins and
restores will carry (trainer/workload.py, trainer/determinism.py, trainer/api.py)."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch
from torch import nn

from recover.trainer import DatasetMicrobatches, FunctionMicrobatches
from recover.trainer.api import _workload
from recover.trainer.buffers import reduced_buckets
from recover.trainer.determinism import check_determinism
from recover.trainer.errors import WorkloadError
from recover.trainer.gradients import GradientBuckets
from recover.trainer.reduction import make_accumulator
from recover.trainer.workload import Workload

torch.set_num_threads(1)
M = 4


class Counter:
    """Extra state: how many steps the user's callback saw."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]


def data(step: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step * 100 + microbatch)
    x = torch.randn(8, 4, generator=gen)
    return x, x.sum(1, keepdim=True).sin()


def mse(model: nn.Module, batch: Any) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def make(loss_fn=mse, seed: int = 0, **extra: Any) -> tuple[Workload, GradientBuckets]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Dropout(0.2), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    source = FunctionMicrobatches(data)
    source.bind(M, seed)
    workload = Workload(model=model, optimizer=optimizer, source=source, seed=seed,
                        loss_fn=loss_fn, **extra)
    return workload, GradientBuckets(workload.params)


def accumulator(mode: str, workload: Workload, grads: GradientBuckets) -> Any:
    """As train() builds it: the gradients, then the buffers (the model has a BatchNorm)."""
    return make_accumulator(mode, reduced_buckets(grads, workload.model_buffers), M)


def train_steps(workload: Workload, grads: GradientBuckets, acc: Any, steps: range) -> list[str]:
    """One replica computing all M microbatches of each step, no collectives."""
    digests = []
    for step in steps:
        acc.reset()
        for mb in range(M):
            acc.before_microbatch()
            result = workload.compute(step, mb)
            grads.repair_views()
            acc.after_microbatch(result.loss)
        reduced = acc.finish(acc.buffers())
        workload.apply(grads, reduced.grads)
        acc.observe_committed(reduced.grads)
        digests.append(workload.digest())  # parameters and buffers
    return digests


# ---------------------------------------------------------------- what the loss returns

@pytest.mark.parametrize("returned, message", [
    (lambda out: (out - 1) ** 2, r"loss of shape \[8, 1\]; it must be a scalar"),
    (lambda out: 3.0, "returned float; it must return the loss as a scalar tensor"),
    (lambda out: out.sum().detach(), "does not require grad"),
    (lambda out: torch.tensor(1), "torch.int64 loss"),
    (lambda out: (out.sum(), 2, 3), "a tuple of 3"),
    (lambda out: (out.sum(), -1), "tokens=-1"),
])
def test_a_broken_loss_is_a_contract_error_naming_the_problem(returned, message) -> None:
    workload, _ = make(lambda model, batch: returned(model(batch[0])))
    with pytest.raises(WorkloadError, match=message) as caught:
        workload.compute(0, 0)
    assert caught.value.deterministic and caught.value.where == "loss_fn"


def test_tokens_are_reported_with_the_loss() -> None:
    workload, _ = make(lambda model, batch: (mse(model, batch), 64))
    result = workload.compute(0, 1)
    assert result.tokens == 64 and result.sample_ids == [1]


def test_an_exception_in_user_code_keeps_only_the_users_frames() -> None:
    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        return helper(batch)

    def helper(batch: Any) -> torch.Tensor:
        raise KeyError("no such column")

    workload, _ = make(loss_fn)
    with pytest.raises(WorkloadError) as caught:
        workload.compute(3, 2)
    error = caught.value
    assert str(error) == "loss_fn raised at step 3, microbatch 2: KeyError: 'no such column'"
    assert not error.deterministic  # it may be a flaky host: another replica gets to try
    assert "in helper" in error.user_traceback and "in loss_fn" in error.user_traceback
    assert "trainer/workload.py" not in error.user_traceback
    assert "trainer/errors.py" not in error.user_traceback
    report = error.report()
    assert (report.where, report.step, report.microbatch) == ("loss_fn", 3, 2)


def test_parameters_missing_from_the_optimizer_are_refused() -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD([model.weight], lr=0.1)
    with pytest.raises(WorkloadError, match="1 trainable parameter"):
        Workload(model=model, optimizer=optimizer, source=FunctionMicrobatches(data), seed=0,
                 loss_fn=mse)


# ---------------------------------------------------------------- train()'s arguments

class FakeJob:
    global_microbatches = M
    seed = 0


@pytest.mark.parametrize("change, message", [
    ({"model": "not a model"}, "model must be a torch.nn.Module"),
    ({"optimizer": None}, "optimizer must be a torch.optim.Optimizer"),
    ({"forward_backward": lambda m, b: 0.0}, "exactly one of loss_fn"),
    ({"loss_fn": None}, "exactly one of loss_fn"),
    ({"max_grad_norm": 0}, "max_grad_norm must be a positive number"),
    ({"max_grad_norm": float("nan")}, "max_grad_norm"),
    ({"lr_scheduler": object()}, "lr_scheduler must have step()"),
    ({"extra_state": {"x": 3}}, r"extra_state\['x'\]"),
    ({"microbatches": [1, 2]}, "DatasetMicrobatches"),
    ({"on_step_committed": 5}, "on_step_committed must be a function"),
])
def test_train_arguments_are_checked(change: dict[str, Any], message: str) -> None:
    model = nn.Linear(2, 1)
    args = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
            "microbatches": data, "loss_fn": mse, "forward_backward": None, "lr_scheduler": None,
            "max_grad_norm": None, "on_step_committed": None, "extra_state": None}
    args.update(change)
    with pytest.raises(WorkloadError, match=message) as caught:
        _workload(FakeJob(), **args)
    assert caught.value.deterministic


# ---------------------------------------------------------------- the determinism check

def test_determinism_check_passes_a_deterministic_workload_and_leaves_no_trace() -> None:
    workload, grads = make(lambda model, batch: mse(model, batch) + 0.01 * torch.rand(()))
    before = {k: v.clone() for k, v in workload.model.state_dict().items()}
    first = check_determinism(workload, grads)
    second = check_determinism(workload, grads)
    assert first.gradient_sha256 == second.gradient_sha256
    for key, value in workload.model.state_dict().items():
        assert torch.equal(value, before[key]), f"{key} changed (batch norm statistics?)"
    assert all(float(b.flat.abs().sum()) == 0.0 for b in grads.buckets)


@pytest.mark.parametrize("rng", ["private generator", "python random"])
def test_determinism_check_catches_an_unseeded_random_generator(rng: str) -> None:
    private = torch.Generator()
    private.seed()

    def noisy(model: nn.Module, batch: Any) -> torch.Tensor:
        out = model(batch[0])
        if rng == "private generator":
            out = out + torch.rand(out.shape, generator=private)
        else:
            out = out + random.random()
        return ((out - batch[1]) ** 2).mean()

    workload, grads = make(noisy)
    with pytest.raises(WorkloadError, match="determinism check failed: microbatch 0 of step 0") \
            as caught:
        check_determinism(workload, grads)
    assert "in parameter" in str(caught.value) and caught.value.deterministic


# ---------------------------------------------------------------- commits and state

def test_clipping_and_the_scheduler_follow_committed_steps() -> None:
    workload, grads = make(max_grad_norm=1e-3)
    workload.lr_scheduler = torch.optim.lr_scheduler.StepLR(workload.optimizer, 1, gamma=0.5)
    acc = accumulator("exact", workload, grads)
    train_steps(workload, grads, acc, range(3))
    assert workload.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 / 8)
    total = torch.cat([p.grad.reshape(-1) for p in workload.params]).norm()
    assert float(total) <= 1e-3 * (1 + 1e-5)  # the applied (reduced) gradient was clipped


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_state_dict_continues_bitwise(mode: str) -> None:
    """What a joining replica or a restore will do: load the state at step k, go on."""
    counter = Counter()
    workload, grads = make(extra_state={"counter": counter})
    workload.lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(workload.optimizer, 6)
    acc = accumulator(mode, workload, grads)
    reference = train_steps(workload, grads, acc, range(3))
    counter.count = 3
    # state_dict() holds references to live tensors, as torch's do: copy it, as a snapshot will.
    state = copy.deepcopy({"workload": workload.state_dict(), "reduction": acc.state_dict()})
    reference += train_steps(workload, grads, acc, range(3, 6))

    joiner_counter = Counter()
    joiner, joiner_grads = make(seed=99, extra_state={"counter": joiner_counter})  # other init
    joiner.lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(joiner.optimizer, 6)
    joiner_acc = accumulator(mode, joiner, joiner_grads)
    joiner.seed = workload.seed  # the job's seed, as init() hands it to every replica
    joiner.load_state_dict(state["workload"])
    joiner_acc.load_state_dict(state["reduction"])
    assert joiner_counter.count == 3
    assert train_steps(joiner, joiner_grads, joiner_acc, range(3, 6)) == reference[3:]


def test_dataset_source_and_dropout_make_a_microbatch_the_same_anywhere() -> None:
    dataset = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
    results = []
    for _ in range(2):
        workload, grads = make()
        workload.source = DatasetMicrobatches(dataset, microbatch_size=5)
        workload.source.bind(M, 0)
        workload.compute(7, 3)  # another replica may have computed anything before
        grads.zero()
        workload.compute(2, 1)
        results.append([b.flat.clone() for b in grads.buckets])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize("owner", ["optimizer", "model"])
def test_zero_grad_inside_a_microbatch_is_refused_and_fine_elsewhere(owner: str) -> None:
    workload: Workload

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        (workload.optimizer if owner == "optimizer" else model).zero_grad()
        return mse(model, batch)

    workload, _ = make(loss_fn)
    with pytest.raises(WorkloadError, match=rf"{owner}.zero_grad\(\) was called while computing"):
        workload.compute(0, 0)
    workload.optimizer.zero_grad()  # between steps (a callback, user code): harmless
    workload.model.zero_grad()


def test_optimizer_parameters_outside_the_model_are_refused() -> None:
    model = nn.Linear(2, 1)
    temperature = nn.Parameter(torch.ones(()))
    optimizer = torch.optim.SGD([*model.parameters(), temperature], lr=0.1)
    with pytest.raises(WorkloadError, match="not trainable parameters of the model"):
        Workload(model=model, optimizer=optimizer, source=FunctionMicrobatches(data), seed=0,
                 loss_fn=mse)
