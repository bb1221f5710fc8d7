"""The reference GPT's training pieces, rebuilt outside ReCoVer for the baselines.

The checkpoint-and-restart and DDP baselines must train exactly the job
ReCoVer's reference worker trains (workloads/tinygpt/__main__.py) so that
their loss curves are comparable: the same model from the job's seed, the
same AdamW, the same corpus walked by the same `DatasetMicrobatches`. They
compute every microbatch with `Workload.compute`, the code ReCoVer's workers
run (its sample order, dropout seeds and loss), rather than a copy of it; both
baselines build their pieces here, so they cannot drift apart either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recover.trainer.sources import DatasetMicrobatches
from recover.trainer.workload import ForwardBackwardFn, Workload
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
    global_microbatches: int

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
        return cls(config, seed, model, optimizer, corpus, global_microbatches)

    @property
    def tokens_per_microbatch(self) -> int:
        return self.config.microbatch_size * self.config.seq_len

    def loss(self, model: torch.nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The reference worker's loss_fn: next-token prediction over one microbatch."""
        _, loss = model(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())
        return loss, self.tokens_per_microbatch

    def workload(self, forward_backward: ForwardBackwardFn | None = None) -> Workload:
        """The pieces as the reference worker hands them to `recover.trainer.train` (its
        source bound to the job's M and seed, as train() does); `forward_backward` replaces
        the loss function where a baseline runs its own backward (DDP's)."""
        source = DatasetMicrobatches(self.corpus, self.config.microbatch_size)
        source.bind(self.global_microbatches, self.seed)
        return Workload(model=self.model, optimizer=self.optimizer, source=source,
                        seed=self.seed, loss_fn=None if forward_backward else self.loss,
                        forward_backward=forward_backward)
