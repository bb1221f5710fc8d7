"""Thread CPU of the example's eval forward after k training steps, with denormals flushed or
not, and how many activations and weights are denormal (eval_in_process.txt)."""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import buffers_micro as bm  # noqa: E402

torch.set_num_threads(1)
x0 = torch.randn(512, 1, 8, 8, generator=torch.Generator().manual_seed(2))
TINY = 1.1754944e-38  # float32's smallest normal


def eval_ms(model) -> float:
    with torch.no_grad():
        model(x0)
        spent = []
        for _ in range(11):
            began = time.thread_time()
            model(x0)
            spent.append(time.thread_time() - began)
    return statistics.median(spent) * 1000


def denormals(model) -> tuple[list[int], int]:
    outputs: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda m, i, o, outputs=outputs: outputs.append(o))
             for m in model]
    with torch.no_grad():
        model(x0)
    for hook in hooks:
        hook.remove()
    count = lambda t: int(((t != 0) & (t.abs() < TINY)).sum())  # noqa: E731
    return [count(o) for o in outputs], sum(count(p) for p in model.parameters())


for v in ("local", "reduce"):
    replica = bm.Replica("exact", v, 76, 4, False)
    for k in range(12):
        model = replica.workload.model
        model.eval()
        torch.set_flush_denormal(False)
        plain = eval_ms(model)
        torch.set_flush_denormal(True)
        flushed = eval_ms(model)
        torch.set_flush_denormal(False)
        if k in (0, 1, 3, 6, 11):
            activations, weights = denormals(model)
            print(v, "after", k, "steps: eval", round(plain, 1), "ms, flushed", round(flushed, 1),
                  "ms; denormal activations", activations, "weights", weights)
        model.train()
        replica.step()
