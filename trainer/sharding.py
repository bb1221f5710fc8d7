"""A sharded replica's model: checked to be sharded over the replica's ranks, and its FSDP2
modules set to reduce the way ReCoVer's guarantee needs.

Within a replica, FSDP2 reduce-scatters each microbatch's gradient over the replica's ranks
(each computed a slice of the microbatch: replica.split_batch) into `.grad` shards that
ReCoVer sums, reduces across replicas shard by shard and applies like any gradient
(gradients.py keeps each shard a view of a flat bucket). Across replicas FSDP does nothing:
there is no global world, and a replica's group never spans replicas.
"""

from __future__ import annotations

from functools import partial

from recover.trainer.errors import contract_error
from recover.trainer.replica import Lockstep, split_batch
from recover.trainer.workload import Workload

SHARD_HINT = ("shard it over the replica's ranks: torch.distributed.fsdp.fully_shard(module, "
              "mesh=job.replica_mesh) on each block, then on the whole model")


def prepare(workload: Workload, lockstep: Lockstep) -> None:
    """Check the model and make it ready; a contract error names what is wrong."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    ranks = lockstep.ranks
    model = workload.model
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    plain = [name for name, p in trainable if not isinstance(p, DTensor)]
    if plain:
        raise contract_error(f"the job has {ranks.size} ranks per replica but the model's "
                             f"parameter {plain[0]!r} (and {len(plain) - 1} more) is not "
                             f"sharded: {SHARD_HINT}", where="train")
    wanted = ranks.mesh.mesh.tolist()
    foreign = [name for name, p in trainable
               if p.device_mesh.ndim != 1 or p.device_mesh.mesh.tolist() != wanted]
    if foreign:
        raise contract_error(f"the model's parameter {foreign[0]!r} is sharded over another "
                             f"mesh than the replica's ranks {wanted}: {SHARD_HINT}",
                             where="train")
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise contract_error(f"the model's parameters are sharded but not by FSDP2: {SHARD_HINT}",
                             where="train")
    for module in modules:
        # Summed then divided by the ranks (the microbatch's mean over its slices): gloo
        # has no pre-scaled sum, and a plain sum keeps the rounding the same everywhere.
        module.set_force_sum_reduction_for_comms(True)
        module.set_requires_gradient_sync(True, recurse=False)
    if workload.model_buffers is not None:
        raise contract_error("the model has buffers (BatchNorm statistics, ...) and buffers="
                             "'reduce' does not work with several ranks per replica yet: pass "
                             "buffers='local' to train() (each rank keeps its own)",
                             where="train")
    workload.split_batch = partial(split_batch, rank=ranks.rank, size=ranks.size)
    workload.combine_digest = lockstep.combine_digest
