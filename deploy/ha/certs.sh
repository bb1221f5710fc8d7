#!/usr/bin/env bash
# The cluster's certificate authority and one certificate per host (and per operator),
# made once on a trusted machine. Copy DIR/ca.pem and each host's NAME.pem + NAME-key.pem
# to that host's RECOVER_TLS_DIR (recover-ha.env); keep DIR/ca-key.pem off the cluster.
#   deploy/ha/certs.sh DIR head1:controller+agent@10.0.0.1,recover-etcd gpu1:agent alice:operator
# NAME: the host's `hostname` (recover-ha.env picks its files by it) or a person;
# ROLES joined by `+`: controller, agent, relay, reader, operator; @ADDRESS,...: what it
# serves on (controllers, relays and etcd members; an etcd member also the name every member shares,
# RECOVER_ETCD_SERVER_NAME). Existing files are kept: rerun to add hosts.
set -euo pipefail
usage="usage: certs.sh DIR NAME:ROLE[+ROLE...][@ADDRESS[,ADDRESS...]] ..."
DIR="${1:?$usage}"; shift
[ $# -gt 0 ] || { echo "$usage" >&2; exit 2; }
# shellcheck disable=SC2206  # RECOVER_BIN may be several words (python -m recover.cli.main)
recover=(${RECOVER_BIN:-recover})
[ -f "$DIR/ca.pem" ] || "${recover[@]}" certs init "$DIR"
for spec in "$@"; do
  if [[ "$spec" != *:* ]]; then echo "certs.sh: $spec: expected NAME:ROLES[@ADDRESSES]" >&2; exit 2; fi
  name="${spec%%:*}"; rest="${spec#*:}"; roles="${rest%%@*}"; hosts=""
  [[ "$rest" == *@* ]] && hosts="${rest#*@}"
  if [ -f "$DIR/$name.pem" ]; then echo "certs.sh: $DIR/$name.pem exists, kept" >&2; continue; fi
  args=()
  for role in ${roles//+/ }; do args+=(--role "$role"); done
  for host in ${hosts//,/ }; do args+=(--host "$host"); done
  "${recover[@]}" certs issue "$DIR" "$name" "${args[@]}"
done
