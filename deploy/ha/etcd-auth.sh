#!/usr/bin/env bash
# Close etcd to everyone but the controllers, once, after the cluster is up: etcd users for
# the controllers' certificates (a client certificate's common name is its etcd user), a
# role that may read and write the jobs' keys (/recover/) and nothing else, then
# authentication on. From then on an agent's, a reader's or an operator's certificate, all
# signed by the same CA, reaches etcd but may neither read nor write a key: only a
# controller can write the leader key, or anything agents follow.
#   deploy/ha/etcd-auth.sh deploy/ha/recover-ha.env head1 head2 etcd3
# The arguments: the controllers' certificate names (certs.sh NAME). Run it where
# RECOVER_TLS_DIR holds root.pem and root-key.pem (certs.sh DIR root:operator): etcd's
# administrator, kept off the cluster like the CA's key. Rerun with new names to add
# controllers (already present users are kept).
set -euo pipefail
source "${1:?usage: etcd-auth.sh ENV_FILE CONTROLLER_NAME ...}"
shift
[ $# -gt 0 ] || { echo "usage: etcd-auth.sh ENV_FILE CONTROLLER_NAME ..." >&2; exit 2; }
[ -n "$RECOVER_TLS_DIR" ] || { echo "etcd-auth.sh: etcd authenticates users by their TLS " \
                                    "certificates: set RECOVER_TLS_DIR" >&2; exit 2; }
endpoints=""
for member in ${RECOVER_ETCD_CLUSTER//,/ }; do
  endpoints="${endpoints:+$endpoints,}https://${member#*=}:$RECOVER_ETCD_CLIENT_PORT"
done
etcdctl() {
  ETCDCTL_API=3 command etcdctl --endpoints "$endpoints" --cacert "$RECOVER_TLS_DIR/ca.pem" \
    --cert "$RECOVER_TLS_DIR/root.pem" --key "$RECOVER_TLS_DIR/root-key.pem" "$@"
}
# The cluster may still be starting (its members find each other first).
for _ in $(seq 120); do etcdctl endpoint health >/dev/null 2>&1 && break; sleep 0.5; done
users=$(etcdctl user list)
new_user() {  # new_user NAME: add a user without password (its certificate proves who it is)
  grep -qx "$1" <<<"$users" && return 1
  etcdctl user add "$1" --no-password >/dev/null
}
if new_user root; then etcdctl user grant-role root root >/dev/null; fi
etcdctl role get recover >/dev/null 2>&1 || etcdctl role add recover >/dev/null
etcdctl role grant-permission recover --prefix=true readwrite /recover/ >/dev/null
for name in "$@"; do
  if new_user "$name"; then etcdctl user grant-role "$name" recover >/dev/null; fi
done
etcdctl auth enable >/dev/null
echo "etcd-auth.sh: authentication on; users root and $*; role recover: /recover/ read-write"
