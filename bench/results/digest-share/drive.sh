#!/usr/bin/env bash
# recover bench overhead at 9.5M: this build (parameters hashed every step on a thread) vs a
# copy whose chunk hash returns zeros (bench only), rotated over rounds. Set-up (as recorded):
#   mkdir -p /tmp/hashpkg /tmp/nohash; git clone -q . /tmp/hashpkg/recover; git clone -q . /tmp/nohash/recover
#   in /tmp/nohash/recover/trainer/digest.py, `_sha256` returns b"\0" * 32 instead of hashing
# (each DIR/recover is imported as `recover` with PYTHONPATH=DIR).
OUT=/tmp/hashab; rm -rf $OUT; mkdir -p $OUT
JOB=(--replicas 2 --global-microbatches 8 --microbatch-size 8 --n-layer 3 --n-embd 512 --n-head 8 --steps 12 --warmup 4 --reps 1)
declare -A PKG=([hash]=/tmp/hashpkg [nohash]=/tmp/nohash)
vs=(hash nohash)
for round in 0 1 2; do
  for i in 0 1; do
    v=${vs[$(( (i + round) % 2 ))]}
    cd ${PKG[$v]}/recover
    PYTHONPATH=${PKG[$v]} "${PYTHON:-python3}" -m recover.cli.main bench overhead "${JOB[@]}" --out $OUT/$v-$round > $OUT/$v-$round.log 2>&1
    echo "round $round $v: $(grep -E 'torch DDP|ReCoVer fast|ReCoVer exact' $OUT/$v-$round.log | tail -3 | tr -s ' ' | tr '\n' ';')"
  done
done
