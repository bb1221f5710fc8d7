#!/usr/bin/env bash
# The GPU check: ReCoVer's jobs on a machine with CUDA GPUs, with a killed worker, in exact
# and fast mode, printing what ran (device named), the recovery times and the bitwise
# verdict. Run it wherever a GPU is at hand and record its output in BENCHMARKS.md ("GPU
# check"); until it has run, the README says GPU execution is untested.
#
#   bash scripts/gpu_check.sh [OUT]            (default OUT: runs/gpu-check)
#
# GPU_CHECK_ON_CPU=1 runs the same jobs without a GPU: a check of this script, nothing more.
# It uses the torch already installed when that torch has CUDA (scripts/setup.sh installs
# a CPU build: on a GPU machine install a CUDA torch first, e.g. into .venv). What runs:
#   1 GPU or more: the group tests that need CUDA (tests/unit/test_groups.py: a CUDA buffer
#     through gloo's pinned staging, the NCCL group's reduce and its abort of a member
#     whose peer never comes; tests/unit/test_overlap.py: a reduction started during
#     backward copies each piece after its kernels, exact mode's pieces too, an overflowing
#     one counted; tests/unit/test_reduction.py: the peaks that set exact mode's scales,
#     read at once); 2 replicas of 1 rank on the GPU(s)
#     (slot modulo the GPUs seen), the cross-replica group on gloo with CUDA buffers staged
#     through pinned host memory:
#     - exact: failure-free vs a replica killed in backward, whose restarted worker (forked
#       from the agent's warm interpreter, CUDA first touched in the child) rejoins by state
#       transfer; checkpoints of CUDA state written and exported; the killed run's sums
#       reduced in pieces during the last backward (--overlap-piece-kb 64: a real model's
#       are 25 MB), the failure-free one's after it (bitwise verdict);
#     - fast: the same kill with a hot spare and mutual TLS (the spare promoted, the
#       restarted worker's state sent over TLS);
#     - BatchNorm buffers reduced (examples/batchnorm.py), exact, through a kill (bitwise
#       verdict, buffers included);
#     - fp16 autocast with ReCoVer's loss scaling (examples/porting.py), exact, through a
#       kill (bitwise verdict).
#   2 GPUs or more: also the cross-replica group on NCCL (--group-backend nccl), a replica
#     per GPU: exact failure-free vs a replica killed in backward (bitwise verdict), and fast
#     with the reduction's pieces started during backward, killed the same way; on one GPU,
#     a one-replica job over NCCL instead (failure-free).
#   4 GPUs or more: also HSDP 2x2 (FSDP2 on each replica's own group: NCCL for CUDA
#     tensors) exact, failure-free vs a rank killed in backward.
set -uo pipefail  # each check reports and the next one runs; the exit status says if any failed
FAILED=0
cd "$(dirname "$0")/.."
OUT="${1:-runs/gpu-check}"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
"$PY" -c "import recover.trainer" 2>/dev/null || "$PY" -m pip install -q --no-build-isolation -e .
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$GPUS" = 0 ] && [ -z "${GPU_CHECK_ON_CPU:-}" ]; then
  echo "gpu_check: no CUDA device visible to torch $("$PY" -c 'import torch; print(torch.__version__)'): nothing checked" >&2
  exit 2
fi
mkdir -p "$OUT"
echo "== device"
command -v nvidia-smi >/dev/null && nvidia-smi -L || true
"$PY" -c "
import torch
cuda = torch.cuda.is_available()
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version() if cuda else None)
for i in range(torch.cuda.device_count() if cuda else 0):
    print('gpu', i, torch.cuda.get_device_name(i))
if not cuda:
    print('no GPU: GPU_CHECK_ON_CPU runs the same jobs on the CPU (a check of this script only)')
"

echo "== the cross-replica groups on the GPU (gloo staging through pinned memory, NCCL), the exact sums"
"$PY" -m pytest -q -rs -s -p no:cacheprovider tests/unit/test_groups.py tests/unit/test_stepdigest.py \
  tests/unit/test_overlap.py tests/unit/test_reduction.py -k "cuda or nccl or gpu" \
  || { echo "gpu_check: group tests failed"; FAILED=1; }

# --compute-ms paces the steps (a sleep per microbatch) so that a restarted worker has
# steps left to rejoin in; the same on both runs of a verdict.
JOB=(--steps 24 -M 8 --seed 1 --quiet --no-plot --compute-ms 40)
run() {  # run NAME ARGS... : one job, its summary's recoveries printed
  local name=$1; shift
  rm -rf "${OUT:?}/$name"
  "$PY" -m recover.cli.main run --out "$OUT/$name" "$@" \
    || { echo "gpu_check: $name failed (logs: $OUT/$name/logs)"; FAILED=1; return 1; }
  "$PY" - "$OUT/$name/summary.json" "$name" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
times = [round(f["recovered_s"], 3) for f in s["failures"] if f.get("recovered_s")]
joins = [("spare" if j["spare"] else "replica") + f" {j['replica']} at {j['entered_at_s']} s"
         for j in s["joins"]]
print(f"{sys.argv[2]}: {s['state']}, {s['steps_committed']} steps, failures "
      f"{[f['phase'] for f in s['failures']]}, kill -> computing again (s) {times}, "
      f"joined {joins}, buffers {s['workload'].get('gradient_buckets')}")
EOF
}
verdict() { "$PY" -m recover.cli.main verify "$OUT/$1" "$OUT/$2" || { echo "gpu_check: $1 vs $2 differ"; FAILED=1; }; }

echo "== 2 replicas x 1 rank on $GPUS GPU(s), exact: a kill, the restarted worker rejoins, checkpoints"
run exact-ref --replicas 2 --reduce exact "${JOB[@]}" -- python examples/hsdp.py
rm -rf "${OUT:?}/ckpt"
run exact-killed --replicas 2 --reduce exact "${JOB[@]}" --kill step=3,replica=1,phase=backward \
  --checkpoint-dir "$OUT/ckpt" --checkpoint-every 8 --overlap-piece-kb 64 -- python examples/hsdp.py
verdict exact-ref exact-killed
grep -h "pieces started reducing" "$OUT/exact-killed/logs/"*.log | sed 's/.*msg="//; s/".*//' | sort -u
"$PY" -m recover.cli.main export "$OUT/ckpt" "$OUT/exported.pt"
"$PY" -c "
import sys, torch
state = torch.load(sys.argv[1], weights_only=True)
print('exported', len(state), 'tensors on', sorted({str(t.device) for t in state.values()}))
" "$OUT/exported.pt"
echo "== 2 replicas x 1 rank + a hot spare, fast, mutual TLS: the spare takes over, the restart joins over TLS"
run fast-tls-spare --replicas 2 --spares 1 --tls "${JOB[@]}" --kill step=3,replica=1,phase=backward \
  -- python examples/hsdp.py
grep -c "over TLS, state before step" "$OUT/fast-tls-spare/logs/controller.log" \
  | sed 's/^/state transfers over TLS: /'
grep -q "over TCP" "$OUT/fast-tls-spare/logs/controller.log" && { echo "gpu_check: a plaintext transfer"; FAILED=1; }
echo "== BatchNorm buffers reduced (examples/batchnorm.py), exact"
run bn-ref --replicas 2 --reduce exact "${JOB[@]}" -- python examples/batchnorm.py
run bn-killed --replicas 2 --reduce exact "${JOB[@]}" --kill step=3,replica=1,phase=backward \
  -- python examples/batchnorm.py
verdict bn-ref bn-killed
echo "== fp16 autocast with ReCoVer's loss scaling (examples/porting.py), exact"
FP16=(--amp fp16 --init-scale 4194304 --eval-every 1000)
run fp16-ref --replicas 2 --reduce exact "${JOB[@]}" -- python examples/porting.py "${FP16[@]}"
run fp16-killed --replicas 2 --reduce exact "${JOB[@]}" --kill step=3,replica=1,phase=backward \
  -- python examples/porting.py "${FP16[@]}"
verdict fp16-ref fp16-killed

if [ "$GPUS" -ge 2 ]; then
  # One agent: its slots 0 and 1 are GPUs 0 and 1 (two agents would both be slot 0, one GPU,
  # which NCCL refuses to share).
  echo "== 2 replicas on 2 GPUs, the cross-replica group on NCCL (--group-backend nccl)"
  NCCL=(--replicas 2 --agents 1 --group-backend nccl)
  run nccl-ref "${NCCL[@]}" --reduce exact "${JOB[@]}" -- python examples/hsdp.py
  run nccl-killed "${NCCL[@]}" --reduce exact "${JOB[@]}" --kill step=3,replica=1,phase=backward \
    -- python examples/hsdp.py
  verdict nccl-ref nccl-killed
  run nccl-fast "${NCCL[@]}" "${JOB[@]}" --overlap-piece-kb 64 --kill step=3,replica=1,phase=backward \
    -- python examples/hsdp.py
elif [ "$GPUS" -ge 1 ]; then
  # Two replicas cannot share one GPU under NCCL: one replica, failure-free, still builds and
  # uses the NCCL group in a job (a world of one).
  echo "== 1 replica on 1 GPU, the cross-replica group on NCCL (a world of one; 2 replicas need 2 GPUs)"
  run nccl-one --replicas 1 --group-backend nccl "${JOB[@]}" -- python examples/hsdp.py
else
  echo "== NCCL in a job skipped: no GPU"
fi

if [ "$GPUS" -ge 4 ]; then
  echo "== HSDP 2 replicas x 2 ranks (FSDP2 over NCCL inside each replica), exact"
  run hsdp-ref --replicas 2 --ranks-per-replica 2 --reduce exact "${JOB[@]}" -- python examples/hsdp.py
  run hsdp-killed --replicas 2 --ranks-per-replica 2 --reduce exact "${JOB[@]}" \
    --kill step=3,replica=1,phase=backward,rank=1 -- python examples/hsdp.py
  verdict hsdp-ref hsdp-killed
else
  echo "== HSDP 2x2 skipped: it needs 4 GPUs (NCCL refuses two ranks of one group on one GPU), $GPUS seen"
fi
exit "$FAILED"
