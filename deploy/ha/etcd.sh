#!/usr/bin/env bash
# One member of the etcd cluster named in RECOVER_ETCD_CLUSTER (Debian: apt-get install -y
# etcd-server). With RECOVER_TLS_DIR set, clients and peers need certificates signed by
# the cluster's CA (--client-cert-auth, --peer-client-cert-auth).
#   deploy/ha/etcd.sh deploy/ha/recover-ha.env m1
set -euo pipefail
source "${1:?usage: etcd.sh ENV_FILE MEMBER_NAME}"
NAME="${2:?usage: etcd.sh ENV_FILE MEMBER_NAME}"
scheme=http; tls=()
if [ -n "$RECOVER_TLS_DIR" ]; then
  scheme=https
  tls=(--cert-file "$RECOVER_TLS_CERT" --key-file "$RECOVER_TLS_KEY"
       --trusted-ca-file "$RECOVER_TLS_CA" --client-cert-auth
       --peer-cert-file "$RECOVER_TLS_CERT" --peer-key-file "$RECOVER_TLS_KEY"
       --peer-trusted-ca-file "$RECOVER_TLS_CA" --peer-client-cert-auth)
fi
cluster=""; IP=""
for member in ${RECOVER_ETCD_CLUSTER//,/ }; do
  cluster="${cluster:+$cluster,}${member%%=*}=$scheme://${member#*=}:$RECOVER_ETCD_PEER_PORT"
  [ "${member%%=*}" = "$NAME" ] && IP="${member#*=}"
done
[ -n "$IP" ] || { echo "etcd.sh: $NAME is not in RECOVER_ETCD_CLUSTER ($RECOVER_ETCD_CLUSTER)" >&2; exit 2; }
exec etcd --name "$NAME" --data-dir "$RECOVER_ETCD_DATA/$NAME" \
  --listen-client-urls "$scheme://$IP:$RECOVER_ETCD_CLIENT_PORT" \
  --advertise-client-urls "$scheme://$IP:$RECOVER_ETCD_CLIENT_PORT" \
  --listen-peer-urls "$scheme://$IP:$RECOVER_ETCD_PEER_PORT" \
  --initial-advertise-peer-urls "$scheme://$IP:$RECOVER_ETCD_PEER_PORT" \
  --initial-cluster "$cluster" --initial-cluster-state new --initial-cluster-token recover \
  "${tls[@]}"
