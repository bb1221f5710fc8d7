#!/usr/bin/env bash
# Run this host's agent: it finds the leading controller among RECOVER_CONTROLLERS
# and follows it through failovers without restarting its workers. The agent runs the
# job's worker command (set on the controllers: RECOVER_WORKER_COMMAND).
#   deploy/ha/agent.sh deploy/ha/recover-ha.env
set -euo pipefail
source "${1:?usage: agent.sh ENV_FILE}"
exec recover agent --controller "$RECOVER_CONTROLLERS" --slots "$RECOVER_SLOTS" \
  --agent-id "$(hostname)" --metrics-port "$RECOVER_METRICS_PORT" --connect-timeout 60
