#!/usr/bin/env bash
# The pod network of an offline kind cluster (create-cluster.sh, KIND_NODE_SOURCE=offline),
# in place of kindnetd, whose image cannot be built here: on each node, Debian's bridge
# plugin with host-local addresses from the node's spec.podCIDR, and a route to every
# other node's pod CIDR through that node's address (the nodes share one container
# network). No masquerading and no NetworkPolicy: pods reach each other, Services and
# the API server, and nothing outside the cluster.
set -euo pipefail
# shellcheck source=hack/kind/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

[[ $# -eq 0 ]] || kind_die "usage: $0 (configures every node of KIND_CLUSTER_NAME)"
kubectl_kind() { "$KUBECTL" --context "$KUBE_CONTEXT" "$@"; }

nodes=$("$KIND" get nodes --name "$KIND_CLUSTER_NAME")
[[ -n $nodes ]] || kind_die "cluster $KIND_CLUSTER_NAME has no nodes"
count=$(wc -l <<<"$nodes")
kind_progress "waiting for the pod CIDRs of $count nodes (kube-controller-manager assigns them)"
for ((i = 0; i < 120; i++)); do
  table=$(kubectl_kind get nodes -o \
    jsonpath='{range .items[*]}{.metadata.name} {.spec.podCIDR} {.status.addresses[?(@.type=="InternalIP")].address}{"\n"}{end}' 2>/dev/null || true)
  ready=$(awk 'NF == 3' <<<"$table" | wc -l)
  ((ready == count)) && break
  sleep 1
done
((ready == count)) || kind_die "only $ready of $count nodes have a pod CIDR and an address after 120 s: $table"

while read -r node cidr _; do
  conf=$(cat <<JSON
{
  "cniVersion": "1.0.0",
  "name": "gpu-dra-kind",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$cidr"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
JSON
)
  routes=""
  while read -r other other_cidr other_ip; do
    [[ $other == "$node" ]] || routes+="ip route replace $other_cidr via $other_ip; "
  done <<<"$table"
  # Traffic bridged between two pods of one node must pass the Service rules too.
  "$CONTAINER_TOOL" exec -i "$node" sh -euc "
    cat > /etc/cni/net.d/10-gpu-dra-kind.conflist
    $routes
    sysctl -qw net.bridge.bridge-nf-call-iptables=1 2>/dev/null || echo 'cni.sh: net.bridge.bridge-nf-call-iptables not settable' >&2
  " <<<"$conf" || kind_die "configuring the pod network of $node failed"
  kind_progress "  $node: bridge cni0 for $cidr, routes to $((count - 1)) other nodes"
done <<<"$table"
