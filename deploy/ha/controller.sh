#!/usr/bin/env bash
# Run one controller of the job on this host (run it on two or more hosts:
# one leads, the others stand by and take over within ~2.5 s of its loss).
#   deploy/ha/controller.sh deploy/ha/recover-ha.env THIS_HOST_IP
set -euo pipefail
source "${1:?usage: controller.sh ENV_FILE HOST_IP}"
HOST="${2:?usage: controller.sh ENV_FILE HOST_IP}"
# shellcheck disable=SC2086  # RECOVER_JOB_ARGS is a list of arguments
exec recover controller $RECOVER_JOB_ARGS --host "$HOST" --port "$RECOVER_CONTROLLER_PORT" \
  --store "$RECOVER_ETCD" --metrics-port "$RECOVER_METRICS_PORT" --controller-id "$(hostname)"
