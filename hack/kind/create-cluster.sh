#!/usr/bin/env bash
# Creates a kind cluster for gpu-dra-driver: the DRA feature gates and runtime config
# of the project's local cluster (FEATURE_GATES / RUNTIME_CONFIG of hack/lib/common.sh), CDI enabled in containerd,
# one control-plane node and KIND_WORKERS (default 1) workers.
#
#   hack/kind/create-cluster.sh                 create the cluster
#   hack/kind/create-cluster.sh --print-config  print the kind config and exit
#
# Env: KIND_CLUSTER_NAME (gpu-dra-driver), KIND_IMAGE (kindest/node:v<K8S_VERSION>;
# built with `kind build node-image` when it cannot be pulled), KIND_WORKERS,
# CONTAINER_TOOL (docker|podman).
set -euo pipefail
# shellcheck source=hack/kind/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

kind_config() {
  local kv
  printf 'kind: Cluster\napiVersion: kind.x-k8s.io/v1alpha4\nname: %s\n' "$KIND_CLUSTER_NAME"
  printf 'featureGates:\n'
  IFS=, read -r -a kv <<<"$FEATURE_GATES"
  local item
  for item in "${kv[@]}"; do printf '  %s: %s\n' "${item%%=*}" "${item#*=}"; done
  printf 'runtimeConfig:\n'
  IFS=, read -r -a kv <<<"$RUNTIME_CONFIG"
  for item in "${kv[@]}"; do printf '  "%s": "%s"\n' "${item%%=*}" "${item#*=}"; done
  cat <<'YAML'
containerdConfigPatches:
  # CDI: the plugin's specs in /var/run/cdi inject the devices (default on in containerd 2).
  - |-
    [plugins."io.containerd.grpc.v1.cri"]
      enable_cdi = true
nodes:
  - role: control-plane
YAML
  local i
  for ((i = 0; i < KIND_WORKERS; i++)); do printf '  - role: worker\n'; done
}

if [[ ${1:-} == --print-config ]]; then
  kind_config
  exit 0
fi
[[ $# -eq 0 ]] || kind_die "usage: $0 [--print-config]"

need kind kubectl "$CONTAINER_TOOL"
if kind get clusters 2>/dev/null | grep -qx "$KIND_CLUSTER_NAME"; then
  kind_progress "cluster $KIND_CLUSTER_NAME exists already"
  exit 0
fi
if ! "$CONTAINER_TOOL" image inspect "$KIND_IMAGE" >/dev/null 2>&1 &&
   ! "$CONTAINER_TOOL" pull "$KIND_IMAGE"; then
  # kind build node-image runs Docker itself; under Podman it fails late and obscurely.
  [[ $CONTAINER_TOOL == docker ]] ||
    kind_die "no $KIND_IMAGE to pull, and building it (kind build node-image) needs Docker; set KIND_IMAGE to a node image $CONTAINER_TOOL can pull"
  kind_progress "no $KIND_IMAGE to pull: building it (kind build node-image --type release $KIND_K8S_TAG)"
  kind build node-image --type release "$KIND_K8S_TAG" --image "$KIND_IMAGE"
fi
config=$(mktemp)
trap 'rm -f "$config"' EXIT
kind_config >"$config"
kind_progress "creating cluster $KIND_CLUSTER_NAME ($KIND_IMAGE)"
kind create cluster --name "$KIND_CLUSTER_NAME" --image "$KIND_IMAGE" --config "$config" --wait 2m
kubectl --context "$KUBE_CONTEXT" get nodes -o wide
kind_progress "next: hack/kind/build-and-load-image.sh && hack/kind/install.sh && hack/kind/demo.sh"
