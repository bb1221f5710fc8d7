"""A replica of several ranks: its model checked to be sharded over them (FSDP2) or to be
this rank's pipeline stage, and set up the way ReCoVer's guarantee needs.

FSDP2: within a replica, FSDP2 reduce-scatters each microbatch's gradient over the replica's ranks
(each computed a slice of the microbatch: replica.split_batch) into `.grad` shards that
ReCoVer sums, reduces across replicas shard by shard and applies like any gradient
(gradients.py keeps each shard a view of a flat bucket). Across replicas FSDP does nothing:
there is no global world, and a replica's group never spans replicas.

Pipeline: each rank's model is its stage (plain parameters), the user's `forward_backward`
runs the schedule (torch.distributed.pipelining on `Job.replica_group`) on the whole
microbatch, and each stage's gradient is reduced across replicas with the same stage of
the others; the replica's loss is the sum of its ranks' (only the last stage has one).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from recover.trainer.digest import local_part
from recover.trainer.errors import contract_error
from recover.trainer.replica import Lockstep, split_batch
from recover.trainer.workload import Workload

SHARD_HINT = ("shard it over the replica's ranks: torch.distributed.fsdp.fully_shard(module, "
              "mesh=job.replica_mesh) on each block, then on the whole model")


def prepare(workload: Workload, lockstep: Lockstep, exact: bool) -> None:
    """Check the model and make it ready; a contract error names what is wrong. A model
    whose parameters are FSDP2 shards is one copy sharded over the replica; one whose
    parameters are plain, trained with `forward_backward=`, is this rank's pipeline stage."""
    from torch.distributed.tensor import DTensor

    ranks = lockstep.ranks
    trainable = [(name, p) for name, p in workload.model.named_parameters() if p.requires_grad]
    plain = [name for name, p in trainable if not isinstance(p, DTensor)]
    if len(plain) == len(trainable) and workload.forward_backward is not None:
        # A pipeline stage: its parameters are its own, reduced across replicas with the
        # same stage of the others; the schedule moves the whole microbatch through the
        # stages, and only the last one has a loss to report (the others return 0). Its
        # buffers are its own too: each microbatch's update (all its chunks, as the schedule
        # ran them) is captured after the schedule and reduced with the stage's gradients.
        lockstep.losses_add_up = True
        if workload.model_buffers is not None:
            workload.determinism_hint = (
                "a PipelineStage built without its shapes (input_args, output_args, "
                "input_grads, output_grads) infers them with an extra forward on its first "
                "step, which moves BatchNorm statistics (examples/batchnorm.py --pipeline "
                "gives them); ")
    elif plain:
        raise contract_error(f"the job has {ranks.size} ranks per replica but the model's "
                             f"parameter {plain[0]!r} (and {len(plain) - 1} more) is not "
                             f"sharded: {SHARD_HINT}; or, for pipeline stages, pass this "
                             "rank's stage with forward_backward= running the schedule",
                             where="train")
    else:
        _prepare_fsdp(workload, lockstep, trainable, exact)
        # Buffers are not sharded: each rank's copy saw its slices of the microbatches.
        lockstep.buffers_averaged = workload.model_buffers is not None
    workload.combine_digest = lockstep.combine_digest


def _prepare_fsdp(workload: Workload, lockstep: Lockstep, trainable: list, exact: bool) -> None:
    from torch.distributed.fsdp import FSDPModule

    ranks = lockstep.ranks
    wanted = ranks.mesh.mesh.tolist()
    foreign = [name for name, p in trainable
               if p.device_mesh.ndim != 1 or p.device_mesh.mesh.tolist() != wanted]
    if foreign:
        raise contract_error(f"the model's parameter {foreign[0]!r} is sharded over another "
                             f"mesh than the replica's ranks {wanted}: {SHARD_HINT}",
                             where="train")
    modules = [m for m in workload.model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise contract_error(f"the model's parameters are sharded but not by FSDP2: {SHARD_HINT}",
                             where="train")
    for module in modules:
        # Summed then divided by the ranks (the microbatch's mean over its slices): gloo
        # has no pre-scaled sum, and a plain sum keeps the rounding the same everywhere.
        module.set_force_sum_reduction_for_comms(True)
        module.set_requires_gradient_sync(True, recurse=False)
    workload.split_batch = partial(split_batch, rank=ranks.rank, size=ranks.size)
    workload.reshard_state = partial(_reshard, workload)
    if not exact:
        # Fast mode sums the step's microbatches in floating point anyway: FSDP keeps them
        # unsharded and reduce-scatters once, at the step's last microbatch (a later
        # one, planned after a failure, is reduce-scattered at its own end). Exact mode
        # needs each microbatch's shard on its own, to quantize it.
        def gradient_sync(last: bool) -> None:
            for module in modules:
                module.set_requires_gradient_sync(last, recurse=False)

        workload.gradient_sync = gradient_sync


def _reshard(workload: Workload, state: dict[str, Any]) -> dict[str, Any]:
    """A state received from a donor rank (or read back) holds this rank's shards as plain
    tensors: wrap each where the model's own state has a DTensor, like it. An optimizer
    that never stepped has no state to compare with yet: it gets one first (a step with a
    learning rate of 0 and zero gradients, which leaves every parameter as it is), which
    the loaded state then replaces."""
    optimizer = workload.optimizer
    if not optimizer.state:
        rates = [group.get("lr") for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            if "lr" in group:
                group["lr"] = 0.0
        for param in workload.params:
            if param.grad is not None:
                local_part(param.grad).zero_()
        optimizer.step()
        for group, rate in zip(optimizer.param_groups, rates, strict=True):
            if rate is not None:
                group["lr"] = rate
    return _like(workload.state_dict(), state)


def _like(own: Any, got: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(own, DTensor) and isinstance(got, torch.Tensor) and not isinstance(got, DTensor):
        return DTensor.from_local(got.to(own.device), own.device_mesh, own.placements,
                                  run_check=False, shape=own.shape, stride=own.stride())
    if isinstance(own, dict) and isinstance(got, dict):
        return {k: _like(own[k], v) if k in own else v for k, v in got.items()}
    if isinstance(own, list | tuple) and isinstance(got, list | tuple) and len(own) == len(got):
        return type(got)(_like(o, g) for o, g in zip(own, got, strict=True))
    return got
