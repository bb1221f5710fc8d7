#!/usr/bin/env bash
# Set up (first time) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Tests with real etcd need the etcd server (Debian package etcd-server).
if ! command -v etcd >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "test: installing etcd-server (log: .venv/apt.log)" >&2
    { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y etcd-server; } \
      > .venv/apt.log 2>&1 || { tail -n 20 .venv/apt.log >&2; echo "test: etcd install failed" >&2; exit 1; }
  else
    echo "test: etcd is not installed; its tests will be skipped (apt-get install -y etcd-server)" >&2
  fi
fi
exec .venv/bin/python -m pytest -q "$@"
