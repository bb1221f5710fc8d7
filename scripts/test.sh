#!/usr/bin/env bash
# Set up (first time) and run the whole test suite. Extra arguments go to pytest.
#   scripts/test.sh --quick   the iteration tier (82 s on 2 cores): every in-process
#                             test, and one real job with a kill in each phase of a step
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--quick" ]; then
  shift
  set -- tests/unit "tests/integration/test_recovery.py::test_a_kill_in_each_phase_of_a_step" "$@"
fi
bash scripts/setup.sh
# Tests with real etcd need the etcd server and etcdctl (etcd-server, etcd-client); the
# network-partition test needs `ip` (iproute2) and root; the deploy recipes' tests need
# Prometheus and promtool (prometheus), systemd-analyze (systemd), a Slurm of their own
# (slurm-wlm, munge) and the compose file's validator (docker-compose; no daemon).
missing=()
command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || missing+=(etcd-client)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
command -v slurmctld >/dev/null 2>&1 || missing+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || missing+=(munge)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "test: installing ${missing[*]} (log: .venv/apt.log)" >&2
    { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}"; } \
      > .venv/apt.log 2>&1 || { tail -n 20 .venv/apt.log >&2; echo "test: installing ${missing[*]} failed" >&2; exit 1; }
  else
    echo "test: ${missing[*]} not installed; the tests that need them will be skipped" \
         "(apt-get install -y ${missing[*]})" >&2
  fi
fi
exec .venv/bin/python -m pytest -q "$@"
