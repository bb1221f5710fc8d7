"""The baselines rebuild the reference GPT job exactly as ReCoVer's reference worker trains it,
and refuse a job that runs any other worker command."""

from __future__ import annotations

import pytest
import torch

from recover.bench.reference import NotReferenceGPT, reference_config, tokens_per_step
from recover.bench.reference_model import ReferenceGPT
from recover.proto import pb
from recover.trainer.sources import DatasetMicrobatches
from recover.trainer.workload import Workload
from recover.workloads.tinygpt import config as tinygpt
from recover.workloads.tinygpt.corpus import CorpusConfig, SyntheticCorpus
from recover.workloads.tinygpt.model import GPTConfig, build_model


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


def test_the_baselines_compute_what_recovers_reference_worker_computes():
    """The baselines run Workload.compute on pieces built like the reference worker's
    (workloads/tinygpt/__main__.py): same loss, tokens, sample ids and gradient, bitwise."""
    cfg = tinygpt.TinyGPTConfig(microbatch_size=3, n_layer=1, n_embd=32, n_head=2, seq_len=16)
    baseline = ReferenceGPT.build(cfg, seed=7, global_microbatches=4).workload()
    # The reference worker's recipe, as an ordinary user of the API writes it.
    model = build_model(GPTConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len,
                                  n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                                  dropout=cfg.dropout), init_seed=7)
    model.train()
    corpus = SyntheticCorpus(CorpusConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len,
                                          corpus_seed=cfg.corpus_seed))
    source = DatasetMicrobatches(corpus, cfg.microbatch_size)
    source.bind(4, 7)  # what recover.trainer.train does with the job's M and seed

    def loss_fn(model, batch):
        _, loss = model(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())
        return loss, cfg.microbatch_size * cfg.seq_len

    worker = Workload(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=cfg.lr),
                      source=source, seed=7, loss_fn=loss_fn)
    for step, microbatch in ((0, 0), (3, 2), (250_000, 3)):  # the last one is in epoch 3
        for w in (baseline, worker):
            w.model.zero_grad(set_to_none=True)
        ours, theirs = baseline.compute(step, microbatch), worker.compute(step, microbatch)
        assert (ours.loss, ours.tokens, ours.sample_ids) == \
            (theirs.loss, theirs.tokens, theirs.sample_ids)
        for a, b in zip(baseline.params, worker.params, strict=True):
            assert torch.equal(a.grad, b.grad)
