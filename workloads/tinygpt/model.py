"""The reference GPT: a tiny causal transformer for the demo, the tests and the benchmarks.

Small enough to train on CPU in seconds, yet a real pre-LayerNorm causal
transformer with dropout, so the determinism guarantees are exercised on the
same kinds of ops (attention, layer norm, RNG-consuming dropout) as a real run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Architecture of the reference model."""

    vocab_size: int = 64
    """Must match the corpus vocabulary."""
    seq_len: int = 32
    """Maximum context; sizes the learned position embedding."""
    n_layer: int = 2
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 64
    """Residual stream width."""
    dropout: float = 0.1
    """Dropout exists on purpose: the trainer seeds it per microbatch, proving
    that determinism covers RNG consumption too, not only the data."""


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError("n_embd must be divisible by n_head")
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        shape = (b, t, self.n_head, c // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Pre-LN causal transformer with a head tied to the token embedding.

    Tying saves a V x C matrix, which at these sizes is a sizeable fraction
    of the model, and keeps the parameter count near 100k.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.seq_len, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2 scaling: residual projections shrink with depth so the
        # residual stream's variance does not grow with n_layer.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * config.n_layer) ** 0.5)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # Small init keeps initial logits near zero, so the loss at init is
        # close to ln(vocab) and tests can check that as a sanity baseline.
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, inputs: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (logits [B, T, V], mean cross-entropy over all targets or None)."""
        _, t = inputs.shape
        if t > self.config.seq_len:
            raise ValueError(f"sequence length {t} exceeds seq_len {self.config.seq_len}")
        pos = torch.arange(t, device=inputs.device)
        x = self.drop(self.tok_emb(inputs) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def build_model(config: GPTConfig, init_seed: int) -> TinyGPT:
    """Build a model whose parameters depend only on (config, init_seed).

    fork_rng restores the caller's global RNG afterwards, so building a model
    (e.g. a replacement replica mid-run) never shifts anyone else's random
    stream, and every replica gets bitwise-identical parameters.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        return TinyGPT(config)


def count_parameters(model: nn.Module) -> int:
    """Unique trainable parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())
