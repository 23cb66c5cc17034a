#!/usr/bin/env bash
# Deletes the kind cluster made by create-cluster.sh and what it left on the host: its
# node containers and their volumes (kind removes both), then the container network
# KIND_NETWORK once no container uses it. Fails, naming them, when any of the
# cluster's containers, volumes or the network are still there afterwards.
set -euo pipefail
# shellcheck source=hack/kind/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

[[ $# -eq 0 ]] || kind_die "usage: $0"
command -v "$CONTAINER_TOOL" >/dev/null || { kind_progress "no $CONTAINER_TOOL: nothing to delete"; exit 0; }
[[ -x $KIND ]] || command -v "$KIND" >/dev/null || kind_die "kind not found (make kind-up installs it)"
t0=$(date +%s)
if "$KIND" get clusters 2>/dev/null | has_line "$KIND_CLUSTER_NAME"; then
  "$KIND" delete cluster --name "$KIND_CLUSTER_NAME"
else
  kind_progress "no kind cluster $KIND_CLUSTER_NAME"
fi
# Containers of the cluster (kind labels them io.x-k8s.kind.cluster=<name>).
leftover=$("$CONTAINER_TOOL" ps -a --filter "label=io.x-k8s.kind.cluster=$KIND_CLUSTER_NAME" --format '{{.Names}}')
if [[ -n $leftover ]]; then
  kind_progress "removing leftover containers: $(tr '\n' ' ' <<<"$leftover")"
  # shellcheck disable=SC2086  # one name per word
  "$CONTAINER_TOOL" rm -f -v $leftover >/dev/null
fi
# Podman's kind nodes keep /var in a volume labelled <node name>=true; kind removes it
# with the node, but not when the creation failed before the node existed.
node_volumes() {
  [[ $CONTAINER_TOOL == podman ]] || return 0
  local node
  for node in "$KIND_CLUSTER_NAME-control-plane" "$KIND_CLUSTER_NAME-worker" "$KIND_CLUSTER_NAME"-worker{2..9}; do
    podman volume ls -q --filter "label=$node" 2>/dev/null
  done
}
volumes=$(node_volumes)
if [[ -n $volumes ]]; then
  kind_progress "removing leftover volumes: $(tr '\n' ' ' <<<"$volumes")"
  # shellcheck disable=SC2086  # one name per word
  podman volume rm -f $volumes >/dev/null
fi
if "$CONTAINER_TOOL" network inspect "$KIND_NETWORK" >/dev/null 2>&1; then
  users=$("$CONTAINER_TOOL" ps -a --filter "network=$KIND_NETWORK" --format '{{.Names}}')
  if [[ -z $users ]]; then "$CONTAINER_TOOL" network rm "$KIND_NETWORK" >/dev/null
  else kind_progress "network $KIND_NETWORK kept: still used by $(tr '\n' ' ' <<<"$users")"
  fi
fi
left=$("$CONTAINER_TOOL" ps -a --filter "label=io.x-k8s.kind.cluster=$KIND_CLUSTER_NAME" --format '{{.Names}}')
[[ -z $left ]] || kind_die "containers of $KIND_CLUSTER_NAME still there: $left"
left=$(node_volumes)
[[ -z $left ]] || kind_die "volumes of $KIND_CLUSTER_NAME still there: $left"
kind_progress "cluster $KIND_CLUSTER_NAME deleted in $(( $(date +%s) - t0 ))s"
