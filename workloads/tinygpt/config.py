"""The reference GPT's own settings, as command-line flags.

`recover run` accepts these flags for its built-in workload and passes them
on in the worker command; the worker parses them back. Checked before anything
starts, so an impossible model is a one-line error, not a worker that dies (or
tries to allocate gigabytes) mid-launch.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass, fields

MODULE = "recover.workloads.tinygpt"
"""`python -m MODULE FLAGS` runs the reference GPT worker."""
MAX_PARAMETERS = 2_000_000_000
"""Refuse a model larger than this: a typo (--n-embd 65536) should not start a job."""


class ConfigError(ValueError):
    """A setting of the reference GPT that cannot work; the message says which and why."""


@dataclass(frozen=True)
class TinyGPTConfig:
    microbatch_size: int = 8
    """Sequences per microbatch (B)."""
    lr: float = 3e-3
    """AdamW learning rate."""
    n_layer: int = 2
    """Transformer blocks."""
    n_embd: int = 64
    """Residual stream width; a multiple of n_head."""
    n_head: int = 4
    """Attention heads per block."""
    seq_len: int = 32
    """Tokens per sequence (the model's context)."""
    vocab_size: int = 64
    """Tokens of the synthetic language."""
    dropout: float = 0.1
    """Dropout probability (seeded per microbatch by ReCoVer)."""
    corpus_seed: int = 1234
    """Identity of the synthetic language."""

    def parameters(self) -> int:
        """Approximate parameter count (embeddings, blocks; the head is tied)."""
        block = 12 * self.n_embd ** 2 + 13 * self.n_embd
        return (self.vocab_size + self.seq_len) * self.n_embd + self.n_layer * block + 2 * self.n_embd

    def check(self) -> None:
        bounds = {"microbatch_size": (1, 65_536), "n_layer": (1, 256), "n_embd": (1, 65_536),
                  "n_head": (1, 1024), "seq_len": (1, 65_536), "vocab_size": (2, 1_048_576),
                  "corpus_seed": (0, 2 ** 63 - 1)}
        for name, (low, high) in bounds.items():
            value = getattr(self, name)
            if not low <= value <= high:
                raise ConfigError(f"--{name.replace('_', '-')} must be in [{low}, {high}], got {value}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"--n-embd ({self.n_embd}) must be a multiple of --n-head "
                              f"({self.n_head})")
        if not 0 < self.lr < math.inf:
            raise ConfigError(f"--lr must be a positive number, got {self.lr}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.parameters() > MAX_PARAMETERS:
            raise ConfigError(f"the reference GPT would have ~{self.parameters():,} parameters "
                              f"(limit {MAX_PARAMETERS:,}): check --n-embd, --n-layer, "
                              "--vocab-size and --seq-len")


DEFAULTS = TinyGPTConfig()
FLAGS = {f.name: "--" + f.name.replace("_", "-") for f in fields(TinyGPTConfig)}


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                  defaults: bool = True) -> None:
    """The reference GPT's flags. With defaults=False they default to None, so a caller
    can tell which were given (`recover run` refuses them next to a command of its own)."""

    def default(name: str) -> object:
        return getattr(DEFAULTS, name) if defaults else None

    parser.add_argument("--microbatch-size", "-B", type=int, default=default("microbatch_size"),
                        help="sequences per microbatch (default 8)")
    parser.add_argument("--lr", type=float, default=default("lr"),
                        help="AdamW learning rate (default 3e-3)")
    parser.add_argument("--n-layer", type=int, default=default("n_layer"), help="(default 2)")
    parser.add_argument("--n-embd", type=int, default=default("n_embd"), help="(default 64)")
    parser.add_argument("--n-head", type=int, default=default("n_head"), help="(default 4)")
    parser.add_argument("--seq-len", type=int, default=default("seq_len"), help="(default 32)")
    parser.add_argument("--vocab-size", type=int, default=default("vocab_size"),
                        help="(default 64)")
    parser.add_argument("--dropout", type=float, default=default("dropout"), help="(default 0.1)")
    parser.add_argument("--corpus-seed", type=int, default=default("corpus_seed"),
                        help="identity of the synthetic language (default 1234)")


def given(args: argparse.Namespace) -> list[str]:
    """The flags of this workload that were set (parsed with defaults=False)."""
    return [FLAGS[name] for name in FLAGS if getattr(args, name, None) is not None]


def from_args(args: argparse.Namespace) -> TinyGPTConfig:
    """The config from parsed flags (None means the default); ConfigError when impossible."""
    values = {name: getattr(args, name) for name in FLAGS if getattr(args, name, None) is not None}
    config = TinyGPTConfig(**{**asdict(DEFAULTS), **values})
    config.check()
    return config


def to_args(config: TinyGPTConfig) -> list[str]:
    return [part for name, value in asdict(config).items() for part in (FLAGS[name], repr(value))]


def command(config: TinyGPTConfig) -> list[str]:
    """The worker command of the built-in workload (agents run `python` as their own)."""
    return ["python", "-m", MODULE, *to_args(config)]


def from_command(argv: list[str]) -> TinyGPTConfig:
    """The config a built-in worker command carries; ConfigError when it is another command."""
    if argv[1:3] != ["-m", MODULE]:
        raise ConfigError(f"not the reference GPT's command: {' '.join(argv[:3])} ...")
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser, defaults=False)
    args, unknown = parser.parse_known_args(argv[3:])
    if unknown:
        raise ConfigError(f"unknown reference GPT flags {unknown}")
    return from_args(args)


def parse(argv: list[str] | None = None) -> TinyGPTConfig:
    """The worker's own command line; a bad value exits with one line and code 2."""
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}",
                                     description="ReCoVer's reference GPT workload")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return from_args(args)
    except ConfigError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
