#!/bin/bash
# CPU per step of the whole job (every process: launcher, controller, agents, workers), from
# the difference of a 50- and a 250-step run, local and reduce alternating which goes first.
# Run from a clone (/tmp/benchclone, on PYTHONPATH as recover via /tmp/benchpkg). What
# cpudrive.txt holds: ROUNDS="0 1 2" MODES="exact fast", then ROUNDS="3 4 5" MODES=fast.
cd /tmp/benchclone
for r in ${ROUNDS:-0 1 2}; do
 for mode in ${MODES:-exact fast}; do
  if [ $((r % 2)) = 1 ]; then vs="reduce local"; else vs="local reduce"; fi
  for v in $vs; do
    for n in 50 250; do
      rm -rf /tmp/cpud-$mode-$v-$n
      PYTHONPATH=/tmp/benchpkg /usr/bin/time -f "%U %S %e" -o /tmp/cpud.time /work/main/.venv/bin/python -m recover.cli.main run --out /tmp/cpud-$mode-$v-$n --quiet --no-plot --replicas 4 --steps $n -M 16 --seed 1 --reduce $mode -- python examples/batchnorm.py --buffers $v --width 76 --eval-every 0 > /dev/null 2>&1
      read u s e < /tmp/cpud.time
      eval "cpu_$n=\$(python3 -c 'print($u+$s)')"
      eval "step_$n=\$(python3 -c \"import json; print(round(json.load(open('/tmp/cpud-$mode-$v-$n/summary.json'))['step_time']['median_s']*1000,1))\")"
    done
    python3 -c "print('round $r $mode $v cpu_ms_per_step', round(($cpu_250-$cpu_50)/200*1000,1), 'step_ms(250)', $step_250, flush=True)"
  done
 done
done
