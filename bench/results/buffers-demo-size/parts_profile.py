"""Each part of buffers_micro.py's step (--as-job, width 8, 2 microbatches) timed in place, 300
steps x 3 repetitions per variant: where the buffers' added time goes (parts_profile.txt).
From the repo's root, with PYTHONPATH naming a folder that holds `recover`:
    python bench/results/buffers-demo-size/parts_profile.py
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import buffers_micro as bm  # noqa: E402

torch.set_num_threads(1)
VARIANTS = [("exact", "local"), ("exact", "reduce"), ("fast", "local"), ("fast", "reduce")]
times: dict[str, list[float]] = {}


def timed(name, fn):
    def wrapped(*args, **kwargs):
        began = time.perf_counter()
        result = fn(*args, **kwargs)
        times.setdefault(name, []).append(time.perf_counter() - began)
        return result
    return wrapped


results: dict = {}
for variant in VARIANTS * 3:
    replica = bm.Replica(*variant, 8, 2, True)
    for _ in range(20):
        replica.step()
    times.clear()
    workload, acc = replica.workload, replica.acc
    workload.compute = timed("compute", workload.compute)
    acc.before_microbatch = timed("before_mb", acc.before_microbatch)
    acc.after_microbatch = timed("after_mb", acc.after_microbatch)
    acc.buffers = timed("buffers", acc.buffers)
    acc.finish = timed("finish", acc.finish)
    workload.apply = timed("apply", workload.apply)
    acc.observe_committed = timed("observe", acc.observe_committed)
    workload.restore_buffers = timed("restore", workload.restore_buffers)
    workload.digest = timed("digest", workload.digest)
    workload.digest_tensors = timed("digest_tensors", workload.digest_tensors)
    step = timed("step", replica.step)
    for _ in range(300):
        step()
    for name, spent in times.items():
        results.setdefault(variant, {}).setdefault(name, []).append(sum(spent) / 300 * 1e6)
for variant in VARIANTS:
    print(variant, {k: round(statistics.median(x), 1) for k, x in results[variant].items()})
