"""The reference GPT's training pieces, rebuilt outside ReCoVer for the baselines.

The checkpoint-and-restart and DDP baselines must train exactly the job
ReCoVer's reference worker trains (workloads/tinygpt/__main__.py) so that
their loss curves are comparable: the same model from the job's seed, the
same AdamW, the same corpus walked without replacement by the same
`EpochSampler`, the same dropout seed per (step, microbatch), seeded in the
same order as `recover.trainer.workload.Workload.compute`. Both baselines
build their pieces here, so they cannot drift apart from each other either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import default_collate

from recover.trainer.sampling import EpochSampler, microbatch_seed
from recover.workloads.tinygpt.config import TinyGPTConfig
from recover.workloads.tinygpt.corpus import CorpusConfig, SyntheticCorpus
from recover.workloads.tinygpt.model import GPTConfig, TinyGPT, build_model


@dataclass
class ReferenceGPT:
    """Model, optimizer and data of one replica of the reference GPT job."""

    config: TinyGPTConfig
    seed: int
    """The job's seed: model init, sample order, dropout."""
    model: TinyGPT
    optimizer: torch.optim.AdamW
    corpus: SyntheticCorpus
    sampler: EpochSampler

    @classmethod
    def build(cls, config: TinyGPTConfig, seed: int, global_microbatches: int) -> ReferenceGPT:
        model = build_model(GPTConfig(vocab_size=config.vocab_size, seq_len=config.seq_len,
                                      n_layer=config.n_layer, n_head=config.n_head,
                                      n_embd=config.n_embd, dropout=config.dropout),
                            init_seed=seed)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
        corpus = SyntheticCorpus(CorpusConfig(vocab_size=config.vocab_size,
                                              seq_len=config.seq_len,
                                              corpus_seed=config.corpus_seed))
        # DatasetMicrobatches binds its sampler to the job's M and seed the same way.
        sampler = EpochSampler(len(corpus), config.microbatch_size, global_microbatches, seed)
        return cls(config, seed, model, optimizer, corpus, sampler)

    def microbatch(self, step: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of one microbatch, with dropout seeded for it."""
        ids = self.sampler.sample_ids(step, microbatch)
        # Seeded before the batch is fetched, as ReCoVer does (this corpus draws from
        # private generators, so the order only matters for fidelity).
        torch.default_generator.manual_seed(microbatch_seed(self.seed, step, microbatch, "dropout"))
        # default_collate is what DatasetMicrobatches collates with (a stack for tensors).
        batch = default_collate([self.corpus[i] for i in ids])
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
