#!/usr/bin/env bash
# Set up ReCoVer in a virtual environment at .venv (idempotent, quick when done before).
# torch is pinned to the CPU build first so nothing pulls a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv" >&2
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.recover-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing torch (CPU) and ReCoVer with test dependencies (log: .venv/setup.log)" >&2
  {
    .venv/bin/python -m pip install --upgrade pip &&
    .venv/bin/python -m pip install "torch==2.13.0" &&
    .venv/bin/python -m pip install -e ".[test,hf]"
  } > .venv/setup.log 2>&1 || { tail -n 30 .venv/setup.log >&2; echo "setup: failed" >&2; exit 1; }
  touch "$stamp"
fi
