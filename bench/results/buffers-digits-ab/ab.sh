cd /work/main
for round in 1 2 3 4 5 6 7 8; do
  for build in old new; do
    if [ $build = old ]; then export PYTHONPATH=/tmp/wtpath; dir=/tmp/wt; else unset PYTHONPATH; dir=/work/main; fi
    rm -rf /tmp/abd/$build-$round
    (cd $dir && timeout 120 /work/main/.venv/bin/python -m recover.cli.main run --out /tmp/abd/$build-$round --replicas 2 --steps 40 -M 4 --agents 1 --quiet --no-plot -- python examples/batchnorm.py > /dev/null 2>&1)
    /work/main/.venv/bin/python -c "
import json,statistics,sys
s=json.load(open('/tmp/abd/$build-$round/summary.json')); t=s['committed_at_s_per_step']
print('$build', $round, round(statistics.median(b-a for a,b in zip(t[3:],t[4:]))*1000,2))"
  done
done
