"""Each part of buffers_micro.py's step (--as-job, width 8, 2 microbatches) timed in place, 300
steps x 3 repetitions per variant: where the buffers' added time goes. Run from the repo root:
PYTHONPATH=<a folder holding recover> python bench/results/buffers-demo-size/parts_profile.py"""
import sys, time, statistics, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import buffers_micro as bm
torch.set_num_threads(1)
T = {}
def timed(name, fn):
    def w(*a, **k):
        t = time.perf_counter(); r = fn(*a, **k); T.setdefault(name, []).append(time.perf_counter() - t); return r
    return w
res = {}
for variant in [("exact", "local"), ("exact", "reduce"), ("fast", "local"), ("fast", "reduce")] * 3:
    r = bm.Replica(*variant, 8, 2, True)
    for _ in range(20): r.step()
    T.clear()
    wl, acc = r.workload, r.acc
    wl.compute = timed("compute", wl.compute)
    acc.before_microbatch = timed("before_mb", acc.before_microbatch)
    acc.after_microbatch = timed("after_mb", acc.after_microbatch)
    acc.buffers = timed("buffers", acc.buffers)
    acc.finish = timed("finish", acc.finish)
    wl.apply = timed("apply", wl.apply)
    acc.observe_committed = timed("observe", acc.observe_committed)
    wl.restore_buffers = timed("restore", wl.restore_buffers)
    wl.digest = timed("digest", wl.digest)
    wl.digest_tensors = timed("digest_tensors", wl.digest_tensors)
    step = timed("step", r.step)
    for _ in range(300): step()
    for k, v in T.items():
        res.setdefault(variant, {}).setdefault(k, []).append(sum(v) / 300 * 1e6)
for v in [("exact", "local"), ("exact", "reduce"), ("fast", "local"), ("fast", "reduce")]:
    print(v, {k: round(statistics.median(x), 1) for k, x in res[v].items()})
