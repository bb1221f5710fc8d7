#!/usr/bin/env bash
# Set up (first time) and run the local fault-tolerant training demo: 4 replicas,
# three workers SIGKILLed mid-step in different phases, same model as a failure-free run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/recover run --replicas 4 --steps 60 --global-microbatches 16 --microbatch-size 8 \
  --kill step=10,replica=1,phase=backward \
  --kill step=25,replica=2,phase=reduce \
  --kill step=40,replica=3,phase=commit \
  --out runs/demo "$@"
