#!/bin/bash
# rounds of (local, reduce), alternating order; per run: step median, eval wall and thread CPU medians
cd /tmp/benchclone
for r in 0 1 2 3 4 5; do
  if [ $((r % 2)) = 0 ]; then order="local reduce"; else order="reduce local"; fi
  for v in $order; do
    rm -f /tmp/evt-$v; rm -rf /tmp/evd-$v-$r
    PYTHONPATH=/tmp/benchpkg /work/main/.venv/bin/python -m recover.cli.main run --out /tmp/evd-$v-$r --quiet --no-plot --replicas 4 --steps 40 -M 16 --seed 1 --reduce exact -- python examples/bn_timed.py --buffers $v --width 76 > /dev/null 2>&1
    python3 -c "
import statistics, json
rows=[l.split() for l in open('/tmp/evt-$v')][5:]
s=json.load(open('/tmp/evd-$v-$r/summary.json'))
print('round $r $v step_ms', round(s['step_time']['median_s']*1000,1), 'eval_wall_ms', round(statistics.median(float(x[1]) for x in rows),1), 'eval_cpu_ms', round(statistics.median(float(x[2]) for x in rows),1), flush=True)"
  done
done
