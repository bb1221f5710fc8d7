"""The trainer's own per-step cost, in one process: the public API's path vs the executor before it.

`api_overhead.py` measures whole jobs, where the 2 shared cores make step times
swing by +-15 % between identical runs. This measures what the public API
changed and nothing else: one replica computing its microbatches of the
reference GPT (data, seeding, forward, backward, accumulation), building the
reduction buffers, finishing them and applying the step (no collectives, no
controller), with the same model, sizes and thread count, in a fresh process
per measurement, alternating the baseline revision and this checkout.

    python bench/scripts/api_overhead_micro.py --out bench/results/api-overhead-micro
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recover.bench.env import environment

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_overhead import export_baseline  # noqa: E402  (a sibling script)

COMMON = """
import sys, time, torch
torch.set_num_threads(1)
L, E, B, M, STEPS, MODE, SEED = {layers}, {width}, {batch}, {micro}, {steps}, "{mode}", 1
"""
BASELINE = COMMON + """
from recover.trainer.data import CorpusConfig, SyntheticCorpus, microbatch_sample_ids, microbatch_seed
from recover.trainer.model import GPTConfig, build_model
from recover.trainer.reduction import FlatGradients, make_accumulator
model = build_model(GPTConfig(n_layer=L, n_embd=E, n_head=4 if E < 512 else 8), init_seed=SEED)
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
corpus = SyntheticCorpus(CorpusConfig())
grads = FlatGradients([p for p in model.parameters() if p.requires_grad])
acc = make_accumulator(MODE, grads, M)
def step(t):
    acc.reset()
    for mb in range(M):
        ids = microbatch_sample_ids(SEED, t, mb, B, corpus.config.num_sequences)
        x, y = corpus.batch(ids)
        torch.default_generator.manual_seed(microbatch_seed(SEED, t, mb, "dropout"))
        acc.before_microbatch()
        _, loss = model(x, y)
        loss.backward()
        acc.after_microbatch(float(loss.detach()))
    reduced = acc.finish(acc.buffer())
    grads.load(reduced.grads)
    opt.step()
    acc.observe_committed(reduced.grads)
"""
CURRENT = COMMON + """
import recover.trainer as rt
from recover.trainer.gradients import GradientBuckets
from recover.trainer.reduction import make_accumulator
from recover.trainer.workload import Workload
from recover.workloads.tinygpt.corpus import CorpusConfig, SyntheticCorpus
from recover.workloads.tinygpt.model import GPTConfig, build_model
model = build_model(GPTConfig(n_layer=L, n_embd=E, n_head=4 if E < 512 else 8), init_seed=SEED)
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
corpus = SyntheticCorpus(CorpusConfig())
source = rt.DatasetMicrobatches(corpus, B)
source.bind(M, SEED)
def loss_fn(model, batch):
    _, loss = model(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())
    return loss, B * 32
work = Workload(model=model, optimizer=opt, source=source, seed=SEED, loss_fn=loss_fn)
grads = GradientBuckets(work.params)
acc = make_accumulator(MODE, grads, M)
def step(t):
    acc.reset()
    for mb in range(M):
        acc.before_microbatch()
        result = work.compute(t, mb)
        grads.repair_views()
        acc.after_microbatch(result.loss)
    reduced = acc.finish(acc.buffers())
    work.apply(grads, reduced.grads)
    acc.observe_committed(reduced.grads)
"""
TIMING = """
step(0)  # warm-up: allocations, first-touch, optimizer state
started = time.perf_counter()
for t in range(1, STEPS + 1):
    step(t)
print((time.perf_counter() - started) / STEPS)
"""
SIZES = {"demo": {"layers": 2, "width": 64, "batch": 8, "micro": 4, "steps": 60},
         "9.5M": {"layers": 3, "width": 512, "batch": 8, "micro": 4, "steps": 6}}


def measure(code: str, shim: Path | None) -> float:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if shim is not None:
        env["PYTHONPATH"] = str(shim)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True, timeout=900)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--baseline", default="cb516f3")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="recover-baseline-") as tmp:
        shim = export_baseline(args.baseline, Path(tmp))
        for size, params in SIZES.items():
            for mode in ("fast", "exact"):
                times: dict[str, list[float]] = {"current": [], "baseline": []}
                for r in range(args.rounds):
                    for which in (("current", "baseline") if r % 2 == 0 else ("baseline", "current")):
                        code = (CURRENT if which == "current" else BASELINE).format(
                            mode=mode, **params) + TIMING
                        times[which].append(measure(code, None if which == "current" else shim))
                current, baseline = (statistics.median(times[k]) for k in ("current", "baseline"))
                results[f"{size}/{mode}"] = {
                    "step_s": {k: [round(v, 5) for v in vs] for k, vs in times.items()},
                    "median_current_s": round(current, 5), "median_baseline_s": round(baseline, 5),
                    "ratio": round(current / baseline, 4)}
                print(f"{size:5} {mode:5}: current {current * 1000:.2f} ms, baseline "
                      f"{baseline * 1000:.2f} ms per step of {params['micro']} microbatches, "
                      f"ratio {current / baseline:.3f}", flush=True)
    (out / "results.json").write_text(json.dumps(
        {"benchmark": "api_overhead_micro", "baseline": args.baseline, "sizes": SIZES,
         "results": results, "environment": environment(), "finished_at": time.time()},
        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
