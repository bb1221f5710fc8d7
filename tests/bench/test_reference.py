"""The baselines rebuild the reference GPT job exactly as ReCoVer's reference worker trains it,
and refuse a job that runs any other worker command."""

from __future__ import annotations

import pytest
import torch

from recover.bench.reference import NotReferenceGPT, reference_config, tokens_per_step
from recover.bench.reference_model import ReferenceGPT
from recover.proto import pb
from recover.trainer.sampling import microbatch_seed
from recover.trainer.sources import DatasetMicrobatches
from recover.workloads.tinygpt import config as tinygpt


def job_with(command: list[str]) -> pb.JobConfig:
    return pb.JobConfig(replicas=2, steps=3, global_microbatches=4, seed=5,
                        workload=pb.WorkloadSpec(command=command))


def test_config_comes_from_the_builtin_command():
    cfg = tinygpt.TinyGPTConfig(microbatch_size=3, lr=1e-3, n_layer=1, n_embd=32, n_head=2,
                                seq_len=16)
    job = job_with(tinygpt.command(cfg))
    assert reference_config(job) == cfg
    assert tokens_per_step(job, cfg) == 4 * 3 * 16


@pytest.mark.parametrize("command", [["python", "train.py"], [],
                                     ["python", "-m", tinygpt.MODULE, "--hidden", "3"]])
def test_other_commands_are_refused_in_one_line(command):
    with pytest.raises(NotReferenceGPT) as info:
        reference_config(job_with(command), "the X baseline")
    assert str(info.value).startswith("the X baseline trains the built-in reference GPT only")
    assert "\n" not in str(info.value)


def test_microbatches_and_dropout_seeds_match_recovers_source():
    gpt = ReferenceGPT.build(tinygpt.TinyGPTConfig(microbatch_size=3, n_layer=1, n_embd=32,
                                                   n_head=2, seq_len=16), seed=7,
                             global_microbatches=4)
    source = DatasetMicrobatches(gpt.corpus, 3)
    source.bind(4, 7)  # what recover.trainer.train does with the job's M and seed
    for step, microbatch in ((0, 0), (3, 2), (250_000, 3)):  # the last one is in epoch 3
        inputs, targets = gpt.microbatch(step, microbatch)
        after = torch.rand(1)
        torch.default_generator.manual_seed(microbatch_seed(7, step, microbatch, "dropout"))
        assert torch.equal(after, torch.rand(1))  # dropout sees ReCoVer's seed
        batch = source.batch(step, microbatch)
        assert torch.equal(inputs, batch[:, :-1]) and torch.equal(targets, batch[:, 1:])
