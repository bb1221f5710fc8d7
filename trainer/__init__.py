"""ReCoVer's trainer library: the public API a training script imports.

    import recover.trainer as rt
    job = rt.init()
    ...
    rt.train(job, model, optimizer, microbatches=..., loss_fn=...)

Everything a script needs is exported here; the submodules are internals.
See README.md "Bring your own model". Exports load on first use, so that the
command-line tools importing small parts of this package (fault specs) do not
pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Job": "api", "TrainResult": "api", "init": "api", "train": "api",
    "Checkpoint": "checkpoint", "CheckpointError": "checkpoint", "load_checkpoint": "checkpoint",
    "WorkloadError": "errors",
    "LossScale": "lossscale",
    "EpochSampler": "sampling", "microbatch_seed": "sampling", "sample_digest": "sampling",
    "stable_seed": "sampling",
    "DatasetMicrobatches": "sources", "FunctionMicrobatches": "sources",
    "MicrobatchSource": "sources",
    "TokenFileDataset": "tokens", "write_token_file": "tokens",
    "Stateful": "workload", "StepInfo": "workload",
}
__all__ = [
    "Checkpoint", "CheckpointError", "DatasetMicrobatches", "EpochSampler",
    "FunctionMicrobatches", "Job", "LossScale", "MicrobatchSource",
    "Stateful", "StepInfo", "TokenFileDataset", "TrainResult", "WorkloadError", "init",
    "load_checkpoint", "microbatch_seed", "sample_digest", "stable_seed", "train",
    "write_token_file",
]

if TYPE_CHECKING:
    from recover.trainer.api import Job, TrainResult, init, train
    from recover.trainer.checkpoint import Checkpoint, CheckpointError, load_checkpoint
    from recover.trainer.errors import WorkloadError
    from recover.trainer.lossscale import LossScale
    from recover.trainer.sampling import EpochSampler, microbatch_seed, sample_digest, stable_seed
    from recover.trainer.sources import DatasetMicrobatches, FunctionMicrobatches, MicrobatchSource
    from recover.trainer.tokens import TokenFileDataset, write_token_file
    from recover.trainer.workload import Stateful, StepInfo


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'recover.trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"recover.trainer.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
