#!/usr/bin/env bash
# Exact mode at size on a GPU: examples/hsdp.py at ~50M parameters, 2 replicas of 1 rank
# on the machine's GPU(s), fast vs exact failure-free (the step time each summary reports,
# side by side in one run), then exact with a replica killed in backward (recovery time).
# BENCHMARKS.md section 13 records what it printed.
#   bash bench/scripts/gpu_exact_cost.sh [OUT]        (default OUT: runs/gpu-exact-cost)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-runs/gpu-exact-cost}"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
MODEL=(--width "${WIDTH:-1024}" --layers "${LAYERS:-4}")
mkdir -p "$OUT"
JOB=(--replicas 2 --steps "${STEPS:-16}" -M 8 --seed 1 --quiet --no-plot)
for run in fast exact exact-killed; do
  reduce=${run%-killed}
  kill=(); [ "$run" = exact-killed ] && kill=(--kill "step=$(( ${STEPS:-16} / 2 )),replica=1,phase=backward")
  rm -rf "${OUT:?}/$run"
  "$PY" -m recover.cli.main run --out "$OUT/$run" --reduce "$reduce" "${JOB[@]}" "${kill[@]}" \
    -- python examples/hsdp.py "${MODEL[@]}" > "$OUT/$run.log" 2>&1 \
    || { echo "$run failed:"; tail -n 20 "$OUT/$run.log"; exit 1; }
done
"$PY" - "$OUT" <<'PYEOF'
import json, statistics, sys
out = sys.argv[1]
runs = {name: json.load(open(f"{out}/{name}/summary.json")) for name in ("fast", "exact", "exact-killed")}
def per_step(s):  # seconds between commits, the first two steps (warm-up) left out
    t = [x for x in s["committed_at_s_per_step"] if x is not None]
    return statistics.median(b - a for a, b in zip(t[2:], t[3:]))
fast, exact = per_step(runs["fast"]), per_step(runs["exact"])
params = runs["fast"]["workload"]["parameters"]
print(f"parameters {params / 1e6:.1f}M; buckets {runs['fast']['workload']['gradient_buckets']}")
print(f"step (median, steps 3..): fast {fast * 1000:.1f} ms, exact {exact * 1000:.1f} ms, exact/fast {exact / fast:.2f}")
killed = runs["exact-killed"]
print(f"exact killed: {killed['state']}, failures {[(f['phase'], f['recovered_s']) for f in killed['failures']]}, "
      f"final digest equals the failure-free exact run: {killed['param_sha256'] == runs['exact']['param_sha256']}")
PYEOF
