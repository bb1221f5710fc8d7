"""ReCoVer's step in variants, and plain torch DDP, side by side: the same job
alternated over rounds (the order rotated each round).

    python bench/scripts/overlap_ab.py --out runs/overlap-ab --rounds 3 [--width 512 --layers 3]
        [--compute-ms 100] [--steps 12] [--variants overlap,after,ddp] [--reduce exact]

Each ReCoVer run is `recover run --replicas 2 -M 8 --reduce fast` (or `--reduce exact`) of
`examples/hsdp.py`
(its transformer at --width/--layers; on a GPU host the model is on the GPU) with the
defaults (`overlap`: the reduction started during the last backward, trainer/overlap.py;
the step digest hashed on a thread, trainer/stepdigest.py) or one changed: `after`
(`--no-overlap-reduce`), `inline` (`--digest-inline`), `fast` (the defaults in fast mode
whatever `--reduce` says: exact mode's cost). The first variant is compared with
each other one (first / other, per round and of the medians). DDP is
`bench/scripts/ddp_gpu_baseline.py` under torchrun (gloo, `no_sync` accumulation: its
buckets reduced during the last backward). Per run: the median step (commit to commit,
from step 3 on) and ReCoVer's split (summary.json's step_time). Writes results.json and
table.md under --out; BENCHMARKS.md section 13 records them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLAGS = {"overlap": [], "after": ["--no-overlap-reduce"], "inline": ["--digest-inline"], "fast": []}
VARIANTS = (*FLAGS, "ddp")


def reduce_mode(args: argparse.Namespace, variant: str) -> str:
    return "fast" if variant == "fast" else args.reduce


def recover_run(args: argparse.Namespace, variant: str, out: Path) -> dict:
    flags = list(FLAGS[variant])
    if args.compute_ms:
        flags += ["--compute-ms", str(args.compute_ms)]
    cmd = [sys.executable, "-m", "recover.cli.main", "run", "--out", str(out), "--replicas", "2",
           "--steps", str(args.steps), "-M", "8", "--seed", "1", "--reduce", reduce_mode(args, variant),
           "--policy", "recover", "--quiet", "--no-plot", *flags, "--", "python",
           "examples/hsdp.py", "--width", str(args.width), "--layers", str(args.layers)]
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=True,
                       timeout=args.run_timeout)
    summary = json.loads((out / "summary.json").read_text())
    times = [t for t in summary["committed_at_s_per_step"] if t is not None]
    step = statistics.median(b - a for a, b in zip(times[2:], times[3:], strict=False))
    return {"step_s": step, "split_s": summary["step_time"], "sha": summary["param_sha256"],
            "buckets": summary["workload"]["gradient_buckets"],
            "parameters": summary["workload"]["parameters"]}


def ddp_run(args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master-port", "29533", "bench/scripts/ddp_gpu_baseline.py", "--width",
           str(args.width), "--layers", str(args.layers), "--steps", str(args.steps)]
    if args.compute_ms:
        cmd += ["--compute-ms", str(args.compute_ms)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    text = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True,
                          timeout=args.run_timeout).stdout
    out.with_suffix(".log").write_text(text)
    line = next(x for x in text.splitlines() if x.startswith("ddp"))
    return {"step_s": float(line.split("median step")[1].split("ms")[0]) / 1000, "line": line}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--compute-ms", type=float, default=0.0)
    parser.add_argument("--variants", default="overlap,after,ddp",
                        help=f"comma-separated, of {', '.join(VARIANTS)}; the first is compared "
                             "with each other one")
    parser.add_argument("--reduce", choices=("fast", "exact"), default="fast")
    parser.add_argument("--run-timeout", type=float, default=600)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or len(variants) < 2:
        parser.error(f"--variants: two or more of {', '.join(VARIANTS)}, got {args.variants!r}")
    first, others = variants[0], variants[1:]
    rounds: list[dict] = []
    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        row: dict = {}
        for variant in order:
            started = time.monotonic()
            out = args.out / f"{variant}-{r + 1}"
            row[variant] = ddp_run(args, out) if variant == "ddp" else \
                recover_run(args, variant, out)
            split = row[variant].get("split_s") or {}
            print(f"round {r + 1} {variant}: step {row[variant]['step_s'] * 1000:.1f} ms "
                  + " ".join(f"{k.removesuffix('_s')} {v * 1000:.1f}" for k, v in split.items())
                  + f" ({time.monotonic() - started:.0f} s)", flush=True)
        rounds.append(row)
    median = {v: statistics.median(row[v]["step_s"] for row in rounds) for v in variants}
    lines = ["| round | " + " | ".join(variants) + " | "
             + " | ".join(f"{first} / {v}" for v in others) + " |",
             "|---" * (len(variants) + len(others) + 1) + "|"]
    for i, row in enumerate(rounds):
        cells = [f"{row[v]['step_s'] * 1000:.1f} ms" for v in variants]
        ratio = [f"{row[first]['step_s'] / row[v]['step_s']:.3f}" for v in others]
        lines.append(f"| {i + 1} | " + " | ".join(cells + ratio) + " |")
    cells = [f"{median[v] * 1000:.1f} ms" for v in variants]
    ratio = [f"**{median[first] / median[v]:.3f}**" for v in others]
    lines.append("| median | " + " | ".join(cells + ratio) + " |")
    table = "\n".join(lines)
    print(table)
    for mode in ("fast", "exact"):
        ours = [v for v in variants if v != "ddp" and reduce_mode(args, v) == mode]
        if ours:
            same = {row[v]["sha"] for row in rounds for v in ours}
            print(f"{mode} mode: {', '.join(ours)} end with the same parameters: {len(same) == 1}")
    (args.out / "table.md").write_text(table + "\n")
    (args.out / "results.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "rounds": rounds,
         "median_step_s": median}, indent=1))


if __name__ == "__main__":
    main()
