#!/usr/bin/env bash
# Run this rack's relay (README "Relays for large jobs"): it listens on RECOVER_RELAY for
# the rack's agents and carries their sessions to the leading controller among
# RECOVER_CONTROLLERS over one stream. Its certificate (this host's) needs the relay role
# and the relay's address: certs.sh DIR rack7:relay@10.1.7.2
#   deploy/ha/relay.sh deploy/ha/recover-ha.env
set -euo pipefail
source "${1:?usage: relay.sh ENV_FILE}"
[ -n "${RECOVER_RELAY:-}" ] || { echo "relay.sh: set RECOVER_RELAY (HOST:PORT to listen on)" >&2; exit 2; }
# shellcheck disable=SC2206  # RECOVER_BIN may be several words (python -m recover.cli.main)
recover=(${RECOVER_BIN:-recover})
exec "${recover[@]}" relay --controller "$RECOVER_CONTROLLERS" --listen "$RECOVER_RELAY" \
  --relay-id "relay-$RECOVER_HOST_NAME"
