#!/usr/bin/env bash
# One member of a 3-member etcd cluster (Debian: apt-get install -y etcd-server).
#   deploy/ha/etcd.sh NAME THIS_HOST_IP "m1=http://10.0.0.1:2380,m2=http://10.0.0.2:2380,m3=http://10.0.0.3:2380"
set -euo pipefail
NAME="${1:?usage: etcd.sh NAME HOST_IP INITIAL_CLUSTER}"; IP="${2:?}"; CLUSTER="${3:?}"
exec etcd --name "$NAME" --data-dir "/var/lib/recover-etcd/$NAME" \
  --listen-client-urls "http://$IP:2379" --advertise-client-urls "http://$IP:2379" \
  --listen-peer-urls "http://$IP:2380" --initial-advertise-peer-urls "http://$IP:2380" \
  --initial-cluster "$CLUSTER" --initial-cluster-state new --initial-cluster-token recover
