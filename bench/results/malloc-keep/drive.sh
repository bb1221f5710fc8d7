#!/usr/bin/env bash
# recover bench overhead at 9.5M parameters (fast, exact, DDP), three environments rotated:
#   keep:    this build as it ships (workers keep freed memory; DDP at glibc's defaults)
#   system:  RECOVER_MALLOC=system (the build before, as far as memory goes)
#   both:    glibc told the same through its environment for every process (DDP too)
# Run from the repository (the build the venv imports); the recorded run used a clone of
# cb5e1e0 put first on PYTHONPATH (`recover` -> the clone) so the tree could change meanwhile.
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/mallocab}
rm -rf $OUT; mkdir -p $OUT
JOB=(--replicas 2 --global-microbatches 8 --microbatch-size 8 --n-layer 3 --n-embd 512 --n-head 8 --steps 12 --warmup 4 --reps 1)
envs=(keep system both)
for round in 0 1 2; do
  for i in 0 1 2; do
    e=${envs[$(( (i + round) % 3 ))]}
    case $e in
      keep) extra=() ;;
      system) extra=(RECOVER_MALLOC=system) ;;
      both) extra=(RECOVER_MALLOC=system MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1073741824) ;;
    esac
    env "${extra[@]}" .venv/bin/python -m recover.cli.main bench overhead "${JOB[@]}" --out $OUT/$e-$round > $OUT/$e-$round.log 2>&1
    echo "round $round $e: $(grep -E 'ddp|fast|exact' $OUT/$e-$round.log | tail -4 | tr '\n' ' ')"
  done
done
