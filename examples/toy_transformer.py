"""The small causal transformer and toy corpus of examples/hsdp.py and examples/pipeline.py
(a helper module of the examples, not an example itself).

Its layers come as a list (`layers`) so a pipeline can cut it into stages; `TinyTransformer`
is the same list as one module.
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, HEADS = 64, 32, 4


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class Embed(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.pos = nn.Parameter(0.02 * torch.randn(SEQ, width))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens) + self.pos[:tokens.shape[1]]


def layers(width: int, depth: int) -> list[nn.Module]:
    """Embedding, `depth` blocks, the head: built from torch's global generator (seed it)."""
    return [Embed(width), *(Block(width) for _ in range(depth)), nn.Linear(width, VOCAB)]


class TinyTransformer(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        embed, *blocks, head = layers(width, depth)
        self.embed, self.blocks, self.head = embed, nn.ModuleList(blocks), head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def corpus(sequences: int = 4096) -> torch.Tensor:
    """A learnable toy language: each token is the previous one plus 1 to 3, mod VOCAB
    (rows of SEQ + 1 tokens: inputs and targets shifted by one)."""
    steps = torch.randint(1, 4, (sequences, SEQ + 1), generator=torch.Generator().manual_seed(7))
    return torch.cumsum(steps, dim=1) % VOCAB


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
