#!/usr/bin/env bash
# The failure-free fast step on a GPU: ReCoVer builds and plain torch DDP side by side,
# alternated over rounds (the builds' order rotates every round): examples/hsdp.py at ~50M
# parameters, 2 replicas of 1 rank sharing the machine's GPU, -M 8, uniform quotas (DDP
# splits evenly too). Per run: the median commit-to-commit step from step 3 on and its
# split (summary.json's step_time); DDP: its median step. BENCHMARKS.md section 13.
#
#   bash bench/scripts/gpu_step_ab.sh OUT ROUNDS NAME=DIR... (e.g. runs/gpu-step-ab 3 before=/tmp/b after=)
#
# Each DIR holds a build as DIR/recover, e.g.
#   mkdir -p /tmp/b/recover && git archive REV | tar -x -C /tmp/b/recover
# and an empty DIR names the build Python imports by itself (the working tree, with -e).
# REDUCE=exact compares the builds in exact mode; DDP=0 leaves DDP out.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:?OUT}"
ROUNDS="${2:?ROUNDS}"
shift 2
declare -A DIRS
NAMES=()
for spec in "$@"; do
  name=${spec%%=*} dir=${spec#*=}
  NAMES+=("$name")
  DIRS[$name]=$([ -n "$dir" ] && cd "$dir" && pwd || true)
done
(( ${#NAMES[@]} )) || { echo "name at least one build: NAME=DIR (an empty DIR: the installed one)"; exit 2; }
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
MODEL=(--width "${WIDTH:-1024}" --layers "${LAYERS:-4}")
STEPS="${STEPS:-16}"
mkdir -p "$OUT"
for round in $(seq 1 "$ROUNDS"); do
  shift_by=$(( (round - 1) % ${#NAMES[@]} ))
  order=("${NAMES[@]:shift_by}" "${NAMES[@]:0:shift_by}")
  extra=(); [ "${DDP:-1}" = 1 ] && extra=(ddp)
  for build in "${order[@]}" "${extra[@]}"; do
    name="$build-$round"
    if [ "$build" = ddp ]; then
      "$PY" -m torch.distributed.run --nproc_per_node 2 --master-port 29533 \
        bench/scripts/ddp_gpu_baseline.py "${MODEL[@]}" --steps "$STEPS" > "$OUT/$name.log" 2>&1 \
        || { echo "$name failed:"; tail -n 20 "$OUT/$name.log"; exit 1; }
      echo "$name: $(grep -m1 '^ddp' "$OUT/$name.log")"
      continue
    fi
    path=${DIRS[$build]}${PYTHONPATH:+:$PYTHONPATH}
    path=${path#:}
    rm -rf "${OUT:?}/$name"
    PYTHONPATH="$path" "$PY" -m recover.cli.main run --out "$OUT/$name" \
      --replicas 2 --steps "$STEPS" -M 8 --seed 1 --reduce "${REDUCE:-fast}" --policy recover --quiet --no-plot \
      -- python examples/hsdp.py "${MODEL[@]}" > "$OUT/$name.log" 2>&1 \
      || { echo "$name failed:"; tail -n 20 "$OUT/$name.log"; exit 1; }
    "$PY" - "$OUT/$name/summary.json" "$name" <<'PYEOF'
import json, statistics, sys
s = json.load(open(sys.argv[1]))
t = [x for x in s["committed_at_s_per_step"] if x is not None]
step = statistics.median(b - a for a, b in zip(t[2:], t[3:]))
split = {k: round(v * 1000, 1) for k, v in (s["step_time"] or {}).items()}
print(f"{sys.argv[2]}: {s['state']}, step {step * 1000:.1f} ms, split (ms) {split}, "
      f"params {s['workload']['parameters'] / 1e6:.1f}M {s['workload']['gradient_buckets']}, "
      f"sha {s['param_sha256'][:16]}")
PYEOF
  done
done
