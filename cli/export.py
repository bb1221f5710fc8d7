"""`recover export CKPT OUT`: a checkpoint's model as a file plain torch (or safetensors) loads."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from recover.cli.jobargs import UsageError

FORMATS = (".pt", ".pth", ".safetensors")


def add_parser(sub: Any) -> None:
    export = sub.add_parser(
        "export", help="write a checkpoint's model as a file plain torch loads",
        description="Read a checkpoint (every byte authenticated with its folder's key) and "
                    "write the model's state_dict, parameters and buffers, to OUT: .pt/.pth for "
                    "torch.load(OUT, weights_only=True), .safetensors for safetensors. The file "
                    "is readable by its owner only, like the checkpoint.")
    export.add_argument("checkpoint", help="a checkpoint file, or a checkpoint folder (its newest "
                                           "authentic file is used)")
    export.add_argument("out", help="the file to write: OUT.pt, OUT.pth or OUT.safetensors")
    export.add_argument("--with-optimizer", action="store_true",
                        help=".pt/.pth only: write {'model', 'optimizer', 'lr_scheduler', 'extra', "
                             "'step'} instead of the model's state_dict alone")


def _unshared(tensors: dict[str, Any]) -> dict[str, Any]:
    """safetensors refuses tensors that share memory (tied weights): each gets its own copy."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        pointer = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if pointer in seen and tensor.numel() else tensor.contiguous()
        seen.add(pointer)
    return out


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.suffix not in FORMATS:
        raise UsageError(f"recover export: {args.out!r}: name the file OUT.pt, OUT.pth or "
                         "OUT.safetensors (the suffix picks the format)")
    if args.with_optimizer and out.suffix == ".safetensors":
        raise UsageError("recover export: --with-optimizer writes a .pt/.pth file (safetensors "
                         "holds tensors only)")
    if not out.parent.is_dir():
        raise UsageError(f"recover export: no folder {str(out.parent)!r} to write {out.name} in")
    import torch

    from recover.trainer.checkpoint import CheckpointError, load_checkpoint

    try:
        checkpoint = load_checkpoint(args.checkpoint)
    except CheckpointError as exc:
        print(f"recover export: {exc}", file=sys.stderr)
        return 1
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        # Owner-only from its first byte, as the checkpoint it comes from.
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            if out.suffix == ".safetensors":
                from safetensors.torch import save

                f.write(save(_unshared(checkpoint.model),
                             metadata={"job_id": checkpoint.job_id, "step": str(checkpoint.step)}))
            else:
                payload: dict[str, Any] = checkpoint.model
                if args.with_optimizer:
                    payload = {"model": checkpoint.model, "optimizer": checkpoint.optimizer,
                               "lr_scheduler": checkpoint.lr_scheduler, "extra": checkpoint.extra,
                               "step": checkpoint.step}
                torch.save(payload, f)
        os.replace(tmp, out)
    except ImportError:
        print("recover export: writing .safetensors needs the safetensors package "
              "(pip install safetensors)", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"recover export: cannot write {args.out!r}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    finally:
        tmp.unlink(missing_ok=True)
    size = sum(t.numel() * t.element_size() for t in checkpoint.model.values())
    print(f"exported the model of job {checkpoint.job_id} after {checkpoint.step} steps "
          f"({len(checkpoint.model)} tensors, {size / 1e6:.1f} MB) from {checkpoint.path} to {out}")
    return 0
