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

from recover.trainer.errors import contract_error
from recover.trainer.replica import Lockstep, split_batch
from recover.trainer.workload import Workload

SHARD_HINT = ("shard it over the replica's ranks: torch.distributed.fsdp.fully_shard(module, "
              "mesh=job.replica_mesh) on each block, then on the whole model")


def prepare(workload: Workload, lockstep: Lockstep) -> None:
    """Check the model and make it ready; a contract error names what is wrong. A model
    whose parameters are FSDP2 shards is one copy sharded over the replica; one whose
    parameters are plain, trained with `forward_backward=`, is this rank's pipeline stage."""
    from torch.distributed.tensor import DTensor

    ranks = lockstep.ranks
    trainable = [(name, p) for name, p in workload.model.named_parameters() if p.requires_grad]
    plain = [name for name, p in trainable if not isinstance(p, DTensor)]
    if workload.model_buffers is not None:
        raise contract_error("the model has buffers (BatchNorm statistics, ...) and buffers="
                             "'reduce' does not work with several ranks per replica yet: pass "
                             "buffers='local' to train() (each rank keeps its own)",
                             where="train")
    if len(plain) == len(trainable) and workload.forward_backward is not None:
        # A pipeline stage: its parameters are its own, reduced across replicas with the
        # same stage of the others; the schedule moves the whole microbatch through the
        # stages, and only the last one has a loss to report (the others return 0).
        lockstep.losses_add_up = True
    elif plain:
        raise contract_error(f"the job has {ranks.size} ranks per replica but the model's "
                             f"parameter {plain[0]!r} (and {len(plain) - 1} more) is not "
                             f"sharded: {SHARD_HINT}; or, for pipeline stages, pass this "
                             "rank's stage with forward_backward= running the schedule",
                             where="train")
    else:
        _prepare_fsdp(workload, lockstep, trainable)
    workload.combine_digest = lockstep.combine_digest


def _prepare_fsdp(workload: Workload, lockstep: Lockstep, trainable: list) -> None:
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
