#!/usr/bin/env bash
# Run this host's agent: it finds the leading controller among RECOVER_CONTROLLERS
# and follows it through failovers without restarting its workers. The agent runs the
# job's worker command (set on the controllers: RECOVER_WORKER_COMMAND).
#   deploy/ha/agent.sh deploy/ha/recover-ha.env
set -euo pipefail
source "${1:?usage: agent.sh ENV_FILE}"
# shellcheck disable=SC2206  # RECOVER_BIN may be several words (python -m recover.cli.main)
recover=(${RECOVER_BIN:-recover})
# Credentials come from the environment recover-ha.env exports (RECOVER_TLS_*); the
# agent id is bound to this host's certificate when it first registers.
# Behind a rack relay (RECOVER_RELAY), through it only: a relay without a leader (a failover)
# must not send its whole rack to the leader directly, the load relays are there to spare it.
exec "${recover[@]}" agent --controller "${RECOVER_RELAY:-$RECOVER_CONTROLLERS}" \
  --slots "$RECOVER_SLOTS" \
  --agent-id "$RECOVER_HOST_NAME" --metrics-port "$RECOVER_AGENT_METRICS_PORT" \
  --metrics-host "$RECOVER_AGENT_METRICS_HOST" --connect-timeout 60
