"""The example's eval forward (512 images, width 76) in one process, of a model trained 3 steps
with buffers="local" and with buffers="reduce" (views of one flat tensor), 8 rounds alternating
(eval_in_process.txt)."""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import buffers_micro as bm  # noqa: E402

torch.set_num_threads(1)
replicas = {v: bm.Replica("exact", v, 76, 4, False) for v in ("local", "reduce")}
for replica in replicas.values():
    for _ in range(3):
        replica.step()
x = replicas["local"].eval_x
spent: dict[str, list[float]] = {v: [] for v in replicas}
for _ in range(8):
    for v, replica in replicas.items():
        model = replica.workload.model
        model.eval()
        with torch.no_grad():
            model(x)
            began = time.perf_counter()
            for _ in range(10):
                model(x)
        spent[v].append((time.perf_counter() - began) / 10 * 1000)
        model.train()
for v, ms in spent.items():
    print(v, round(statistics.median(ms), 2), [round(a, 1) for a in ms])
