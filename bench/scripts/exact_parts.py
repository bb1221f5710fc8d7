"""Where exact mode's time goes against fast mode's, one replica in one process: the model of
`examples/hsdp.py` (its transformer at --width/--layers) on the GPU when there is one, its
steps run the way a replica runs them, each part timed on its own.

    python bench/scripts/exact_parts.py [--width 1024 --layers 4 --microbatches 4 --steps 8]

Per microbatch: forward + backward + the loss read (`float(loss)`, as every replica does),
then the accumulator's `after_microbatch` (fast: nothing; exact: quantize, check, add),
each timed with the device synchronised after it. Per step: `buffers()` + `finish()` (no
collective: a world of one), the optimizer step, `observe_committed` (exact: the next
step's scales). Then whole steps without the synchronisations between parts (what a
replica's step costs). Host memory is kept for the next step as in a worker
(trainer/memory.py; RECOVER_MALLOC=system: not). The variants alternate, their order
rotated each step; medians over --steps. BENCHMARKS.md section 13 records what it printed
on a GPU, section 4e on the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from toy_transformer import TinyTransformer, corpus, cross_entropy  # noqa: E402

from recover.trainer.gradients import GradientBuckets  # noqa: E402
from recover.trainer.memory import keep_freed_memory  # noqa: E402
from recover.trainer.reduction import make_accumulator  # noqa: E402

VARIANTS = ("fast", "exact", "exact-again")
"""`exact-again`: a second exact accumulator like the first, a control. On the CPU the two
differed by ~3 ms a step in `finish` (their buffers' placement, presumably)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4, help="per step (one replica's)")
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    told = keep_freed_memory()  # as a worker does (RECOVER_MALLOC=system: not)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.use_deterministic_algorithms(True)  # as examples/hsdp.py in exact mode
    else:
        torch.set_num_threads(1)
    torch.manual_seed(1)
    model = TinyTransformer(args.width, args.layers).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    grads = GradientBuckets(list(model.parameters()))
    accumulators = {name: make_accumulator(name.removesuffix("-again"), grads, args.microbatches)
                    for name in VARIANTS}
    data = corpus()
    batches = [data[i * args.microbatch_size:(i + 1) * args.microbatch_size].to(device)
               for i in range(args.microbatches)]
    parameters = sum(p.numel() for p in model.parameters())
    print(f"{device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), "
          f"{parameters / 1e6:.1f}M parameters, {args.microbatches} microbatches a step, "
          f"torch {torch.__version__}; {told}")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def timed(into: list[float], work: Callable[[], object], split: bool) -> object:
        started = time.perf_counter()
        out = work()
        if split:
            sync()
            into.append(time.perf_counter() - started)
        return out

    def forward_backward(batch: torch.Tensor) -> float:
        loss = cross_entropy(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        return float(loss.detach())  # the replica reads it: a wait for the device

    def step(name: str, parts: dict[str, list[float]], split: bool) -> None:
        acc = accumulators[name]
        acc.reset()
        for batch in batches:
            acc.before_microbatch()
            loss = timed(parts["forward+backward+loss read"], lambda b=batch: forward_backward(b),
                         split)
            timed(parts["after_microbatch"], lambda v=loss: acc.after_microbatch(v), split)
        reduced = timed(parts["buffers+finish"],
                        lambda: acc.finish([b.clone() for b in acc.buffers()]), split)
        for bucket, mean in zip(grads.buckets, reduced.grads, strict=True):
            bucket.flat.copy_(mean)
        timed(parts["optimizer"], optimizer.step, split)
        timed(parts["observe_committed"], lambda: acc.observe_committed(reduced.grads), split)
        sync()

    for name in VARIANTS:  # warm-up: allocations, kernels' first launch
        step(name, defaultdict(list), split=False)
    split_times = {name: defaultdict(list) for name in VARIANTS}
    whole: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for index in range(args.steps):
        order = names[index % len(names):] + names[:index % len(names)]  # rotated each step
        for name in order:
            step(name, split_times[name], split=True)
        for name in order:
            started = time.perf_counter()
            step(name, defaultdict(list), split=False)
            whole[name].append(time.perf_counter() - started)
    per_step = {"after_microbatch": args.microbatches, "forward+backward+loss read": args.microbatches}
    print("| part (ms a step, median) | " + " | ".join(VARIANTS) + " |")
    print("|---" * (len(VARIANTS) + 1) + "|")
    for part in split_times["fast"]:
        cells = [statistics.median(split_times[name][part]) * 1000 * per_step.get(part, 1)
                 for name in VARIANTS]
        print(f"| {part} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    cells = [statistics.median(whole[name]) * 1000 for name in VARIANTS]
    print("| **whole step, no waits between parts** | "
          + " | ".join(f"**{c:.2f}**" for c in cells) + " |")
    fast = statistics.median(whole["fast"])
    for name in list(VARIANTS)[1:]:
        print(f"{name} / fast: {statistics.median(whole[name]) / fast:.3f}")


if __name__ == "__main__":
    main()
