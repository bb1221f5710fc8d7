"""The reference GPT worker: `python -m recover.workloads.tinygpt [FLAGS]`, started by an agent.

An ordinary user of the public API: it builds the model from the job's seed,
walks the synthetic corpus with ReCoVer's epoch sampler and reports its
tokens; ReCoVer does the rest.
"""

from __future__ import annotations

import sys

import torch

import recover.trainer as rt
from recover.workloads.tinygpt.config import parse
from recover.workloads.tinygpt.corpus import CorpusConfig, SyntheticCorpus
from recover.workloads.tinygpt.model import GPTConfig, build_model


def main(argv: list[str] | None = None) -> int:
    config = parse(argv)
    job = rt.init()
    model = build_model(GPTConfig(vocab_size=config.vocab_size, seq_len=config.seq_len,
                                  n_layer=config.n_layer, n_head=config.n_head,
                                  n_embd=config.n_embd, dropout=config.dropout),
                        init_seed=job.seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    corpus = SyntheticCorpus(CorpusConfig(vocab_size=config.vocab_size, seq_len=config.seq_len,
                                          corpus_seed=config.corpus_seed))
    tokens = config.microbatch_size * config.seq_len

    def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        _, loss = model(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())
        return loss, tokens

    result = rt.train(job, model, optimizer, loss_fn=loss_fn,
                      microbatches=rt.DatasetMicrobatches(corpus, config.microbatch_size))
    return 0 if result.success else 1


if __name__ == "__main__":
    sys.exit(main())
