#!/bin/bash
# old vs new build, alternating: 8 replicas, M 32 (4 each), 50 ms of emulated compute per
# microbatch; a kill in forward at steps 4 and 8: survivors have 3 microbatches left then.
for r in 0 1 2 3; do
  if [ $((r % 2)) = 0 ]; then order="old new"; else order="new old"; fi
  for b in $order; do
    out=/tmp/ovl-$b-$r; rm -rf $out
    cd /tmp/rs-$b && PYTHONPATH=/tmp/rsp-$b timeout 300 /work/main/.venv/bin/python -m recover.cli.main run --out $out --quiet --no-plot --replicas 8 --agents 2 --steps 12 -M 32 --compute-ms 50 --max-restarts 0 --kill step=4,replica=3,phase=forward --kill step=8,replica=5,phase=forward > /dev/null 2>&1
    python3 - <<PY
import json, statistics
s = json.load(open("$out/summary.json"))
t = s["committed_at_s_per_step"]
d = [b - a for a, b in zip(t, t[1:])]
fs = s["failures"]
print("$r $b", "recovered_ms", [round(f["recovered_s"] * 1000) for f in fs],
      "failed steps ms", [round(d[f["step"] - 1] * 1000) for f in fs],
      "median step ms", round(statistics.median(d[2:]) * 1000),
      "phases", [{k: round(v * 1000) for k, v in p.items()} for p in s["recovery_phases_s"]], flush=True)
PY
  done
done
