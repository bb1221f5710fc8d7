"""A Hugging Face `transformers` GPT-2 under ReCoVer, trained on real text.

The model is built from a tiny config (no weights are downloaded); the corpus
is the Python standard library's own source code, tokenised by bytes into a
nanoGPT-style token file that every worker reads through a memory map.

    pip install 'transformers>=4.40'          # or: pip install -e '.[hf]'
    recover run --replicas 4 --steps 40 -M 16 -- python examples/hf_gpt2.py
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import recover.trainer as rt

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--n-layer", type=int, default=2)
parser.add_argument("--n-embd", type=int, default=64)
parser.add_argument("--n-head", type=int, default=4)
parser.add_argument("--microbatch-size", type=int, default=8)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--corpus-mb", type=float, default=2.0, help="bytes of stdlib source to use")
parser.add_argument("--data", default=None, help="the token file (default: in the temp folder)")
args = parser.parse_args()

try:
    from transformers import GPT2Config, GPT2LMHeadModel
except ImportError:
    print("examples/hf_gpt2.py needs transformers: pip install 'transformers>=4.40'",
          file=sys.stderr)
    raise SystemExit(2) from None


def stdlib_token_file(megabytes: float, path: Path) -> Path:
    """The first `megabytes` of the stdlib's .py files (sorted by path), one token per byte."""
    if path.exists():
        return path
    wanted = int(megabytes * 1e6)
    chunks, size = [], 0
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        chunks.append(source.read_bytes())
        size += len(chunks[-1])
        if size >= wanted:
            break
    tokens = np.frombuffer(b"".join(chunks)[:wanted], dtype=np.uint8)
    return rt.write_token_file(path, tokens, "uint16")  # atomic: workers may race to build it


job = rt.init()
# Named after the interpreter whose sources it holds: hosts with another Python build theirs.
origin = rt.stable_seed(sys.version, sysconfig.get_paths()["stdlib"]) % 10**8
data = Path(args.data or Path(tempfile.gettempdir()) / f"recover-stdlib-{args.corpus_mb}mb-{origin}.bin")
dataset = rt.TokenFileDataset(stdlib_token_file(args.corpus_mb, data), seq_len=args.seq_len)

torch.manual_seed(job.seed)
config = GPT2Config(vocab_size=256, n_positions=args.seq_len, n_embd=args.n_embd,
                    n_layer=args.n_layer, n_head=args.n_head)
model = GPT2LMHeadModel(config)
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))


def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)), targets.numel()


def log(info: rt.StepInfo) -> None:
    if info.is_first_replica:
        print(f"step {info.step}: loss {info.loss:.4f} ({info.tokens} tokens, lr {info.lr:.1e})",
              flush=True)


result = rt.train(job, model, optimizer, loss_fn=loss_fn, lr_scheduler=warmup, max_grad_norm=1.0,
                  microbatches=rt.DatasetMicrobatches(dataset, microbatch_size=args.microbatch_size),
                  on_step_committed=log)
raise SystemExit(0 if result.success else 1)
