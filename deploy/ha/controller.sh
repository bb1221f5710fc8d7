#!/usr/bin/env bash
# Run one controller of the job on this host (run it on two or more hosts:
# one leads, the others stand by and take over within ~2.5 s of its loss).
#   deploy/ha/controller.sh deploy/ha/recover-ha.env THIS_HOST_IP
set -euo pipefail
source "${1:?usage: controller.sh ENV_FILE HOST_IP}"
HOST="${2:?usage: controller.sh ENV_FILE HOST_IP}"
# The worker command goes last, after `--` (its own flags are the script's business).
command=()
# shellcheck disable=SC2206  # RECOVER_WORKER_COMMAND is a list of words
[ -n "${RECOVER_WORKER_COMMAND:-}" ] && command=(-- $RECOVER_WORKER_COMMAND)
# shellcheck disable=SC2206  # RECOVER_BIN may be several words (python -m recover.cli.main)
recover=(${RECOVER_BIN:-recover})
# Credentials come from the environment recover-ha.env exports (RECOVER_TLS_*).
# shellcheck disable=SC2086  # RECOVER_JOB_ARGS is a list of arguments
flags=(); [ -z "${RECOVER_METRICS_PLAIN:-}" ] || flags=(--metrics-plain)
# An empty RECOVER_TLS_DIR is the operator's word that nobody else reaches these hosts:
# the plaintext store is then allowed (a controller refuses it otherwise).
[ -n "$RECOVER_TLS_DIR" ] || flags+=(--insecure-store)
exec "${recover[@]}" controller $RECOVER_JOB_ARGS --host "$HOST" --port "$RECOVER_CONTROLLER_PORT" \
  --store "$RECOVER_ETCD" --metrics-port "$RECOVER_METRICS_PORT" "${flags[@]}" \
  --controller-id "$RECOVER_HOST_NAME" --summary-out "$RECOVER_SUMMARY_DIR" "${command[@]}"
