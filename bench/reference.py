"""Which reference-GPT settings a benchmark job trains, read from its worker command.

The baselines (checkpoint-and-restart, plain DDP) re-implement the training
loop of the built-in workload, so they can only run a job whose worker is
`python -m recover.workloads.tinygpt FLAGS`: its flags are the model, data and
optimizer settings they must reproduce. Torch-free, so the CLI can check a job
before anything starts.
"""

from __future__ import annotations

from recover.proto import pb
from recover.workloads.tinygpt import config as tinygpt
from recover.workloads.tinygpt.config import TinyGPTConfig


class NotReferenceGPT(ValueError):
    """The job runs a worker command other than the built-in reference GPT; one-line message."""


def reference_config(job: pb.JobConfig, who: str = "this benchmark") -> TinyGPTConfig:
    """The reference GPT's settings of `job`; NotReferenceGPT naming `who` when it runs
    another workload (a baseline cannot re-implement an arbitrary user script)."""
    try:
        return tinygpt.from_command(list(job.workload.command))
    except tinygpt.ConfigError as exc:
        raise NotReferenceGPT(f"{who} trains the built-in reference GPT only, not a worker "
                              f"command of your own ({exc}); give its settings as flags "
                              "(-B, --lr, --n-layer, ...) instead of a command") from None


def tokens_per_step(job: pb.JobConfig, config: TinyGPTConfig) -> int:
    """Tokens one committed step trains: M x B x seq_len, what the reference worker reports."""
    return job.global_microbatches * config.microbatch_size * config.seq_len
