#!/usr/bin/env bash
# Creates a kind cluster for gpu-dra-driver: the DRA feature gates and runtime config
# of the project's local cluster (FEATURE_GATES / RUNTIME_CONFIG of hack/lib/common.sh),
# CDI enabled in containerd, one control-plane node and KIND_WORKERS (default 1) workers.
#
#   hack/kind/create-cluster.sh                 create the cluster (installs podman and
#                                               kind first when missing: hack/kind/tools.sh)
#   hack/kind/create-cluster.sh --print-config  print the kind config and exit
#
# The node image (KIND_NODE_SOURCE):
#   registry  KIND_IMAGE (kindest/node:v<K8S_VERSION>), pulled when not present; kind's
#             own CNI (kindnetd) and CoreDNS
#   offline   KIND_OFFLINE_IMAGE, built here without any registry by
#             hack/kind/build-node-image.sh; Debian's bridge CNI plugin configured per
#             node by hack/kind/cni.sh, NetworkPolicies enforced by kube-network-policies
#             (hack/kind/network-policies.sh; KIND_NETWORK_POLICIES=0 leaves it out);
#             no CoreDNS (no image for it)
#   auto      (default) registry when KIND_IMAGE is present or can be pulled, else offline
#
# Env: KIND_CLUSTER_NAME (gpu-dra-driver), KIND_WORKERS (1), KIND_NODE_SOURCE (auto),
# KIND_IMAGE, KIND_OFFLINE_IMAGE, CONTAINER_TOOL (docker|podman), KIND_RETAIN=1 (keep a
# cluster whose creation failed, for debugging), KIND_NETWORK_POLICIES (1; 0: no
# NetworkPolicy enforcement on the offline node image).
set -euo pipefail
# shellcheck source=hack/kind/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

[[ $KIND_WORKERS =~ ^[0-9]$ ]] || kind_die "KIND_WORKERS must be a number from 0 to 9, not '$KIND_WORKERS'"
KIND_NODE_SOURCE=${KIND_NODE_SOURCE:-auto}
case $KIND_NODE_SOURCE in auto|registry|offline) ;;
  *) kind_die "KIND_NODE_SOURCE must be auto, registry or offline, not '$KIND_NODE_SOURCE'" ;;
esac

# Host facts that change the node configuration (measured, not assumed).
host_cgroup_v1() { [[ ! -f /sys/fs/cgroup/cgroup.controllers ]]; }
host_lacks_sys_resource() { # CAP_SYS_RESOURCE (bit 24) outside the bounding set
  local bnd
  bnd=$(sed -n 's/^CapBnd:\s*//p' /proc/self/status)
  (( (16#$bnd >> 24 & 1) == 0 ))
}

kind_config() { # <registry|offline>
  local source=$1 kv item
  printf 'kind: Cluster\napiVersion: kind.x-k8s.io/v1alpha4\nname: %s\n' "$KIND_CLUSTER_NAME"
  printf 'featureGates:\n'
  IFS=, read -r -a kv <<<"$FEATURE_GATES"
  for item in "${kv[@]}"; do printf '  %s: %s\n' "${item%%=*}" "${item#*=}"; done
  printf 'runtimeConfig:\n'
  IFS=, read -r -a kv <<<"$RUNTIME_CONFIG"
  for item in "${kv[@]}"; do printf '  "%s": "%s"\n' "${item%%=*}" "${item#*=}"; done
  if [[ $source == offline ]]; then
    cat <<YAML
networking:
  # No kindnetd image (not on the Go module proxy): hack/kind/cni.sh configures
  # Debian's bridge plugin on each node once the nodes have their pod CIDRs.
  disableDefaultCNI: true
  kubeProxyMode: nftables
YAML
  fi
  printf 'kubeadmConfigPatches:\n'
  if [[ $source == offline ]]; then
    cat <<YAML
  - |
    kind: ClusterConfiguration
    # The node image's own images (hack/kind/build-node-image.sh); nothing is pulled.
    imageRepository: $KIND_COMPONENT_REPO
    etcd:
      local:
        imageTag: "$ETCD_VERSION"
    # No CoreDNS image: in-cluster DNS names do not resolve (the driver uses none).
    dns:
      disabled: true
YAML
  fi
  printf '  - |\n    kind: KubeletConfiguration\n'
  # The kubelet refuses cgroup v1 unless told otherwise (default true since 1.35).
  if host_cgroup_v1; then printf '    failCgroupV1: false\n'; fi
  # The kubelet's own oom_score_adj (-999) needs CAP_SYS_RESOURCE.
  if host_lacks_sys_resource; then printf '    oomScoreAdj: 0\n'; fi
  cat <<'YAML'
containerdConfigPatches:
  # CDI: the plugin's specs in /var/run/cdi inject the devices (default on in containerd 2).
  - |-
    [plugins."io.containerd.grpc.v1.cri"]
      enable_cdi = true
YAML
  if host_lacks_sys_resource; then
    cat <<'YAML'
  # Pods' oom_score_adj clamped to containerd's: lowering it needs CAP_SYS_RESOURCE.
  - |-
    [plugins."io.containerd.grpc.v1.cri"]
      restrict_oom_score_adj = true
YAML
  fi
  printf 'nodes:\n  - role: control-plane\n'
  local i
  for ((i = 0; i < KIND_WORKERS; i++)); do printf '  - role: worker\n'; done
}

if [[ ${1:-} == --print-config ]]; then
  [[ $# -eq 1 ]] || kind_die "usage: $0 [--print-config]"
  source=$KIND_NODE_SOURCE
  [[ $source == auto ]] && source=registry
  kind_config "$source"
  exit 0
fi
[[ $# -eq 0 ]] || kind_die "usage: $0 [--print-config]"

"$KIND_DIR/tools.sh" ensure
KIND=$("$KIND_DIR/tools.sh" kind)
if [[ $CONTAINER_TOOL == podman ]]; then export CONTAINERS_CONF=$PODMAN_CONF; fi
if "$KIND" get clusters 2>/dev/null | has_line "$KIND_CLUSTER_NAME"; then
  kind_progress "cluster $KIND_CLUSTER_NAME exists already (make kind-down deletes it)"
  exit 0
fi

source=$KIND_NODE_SOURCE
if [[ $source == auto ]]; then
  if "$CONTAINER_TOOL" image inspect "$KIND_IMAGE" >/dev/null 2>&1; then source=registry
  else
    kind_progress "trying to pull $KIND_IMAGE (KIND_NODE_SOURCE=offline skips this)"
    if timeout 120 "$CONTAINER_TOOL" pull "$KIND_IMAGE" >/dev/null 2>&1; then source=registry
    else
      kind_progress "$KIND_IMAGE cannot be pulled: building the node image here (KIND_NODE_SOURCE=offline)"
      source=offline
    fi
  fi
fi
if [[ $source == registry ]]; then
  image=$KIND_IMAGE
  "$CONTAINER_TOOL" image inspect "$image" >/dev/null 2>&1 || "$CONTAINER_TOOL" pull "$image" ||
    kind_die "cannot pull $image; KIND_NODE_SOURCE=offline builds a node image without a registry"
else
  image=$KIND_OFFLINE_IMAGE
  "$KIND_DIR/build-node-image.sh"
fi

config=$(mktemp)
created=false
cleanup() {
  local rc=$?
  rm -f "$config"
  if ((rc != 0)) && $created && [[ ${KIND_RETAIN:-0} != 1 ]]; then
    kind_progress "creation failed: deleting cluster $KIND_CLUSTER_NAME, its volumes and network (KIND_RETAIN=1 keeps them)"
    "$KIND_DIR/delete-cluster.sh" >&2 || true
  fi
}
trap cleanup EXIT
kind_config "$source" >"$config"
t0=$(date +%s)
kind_progress "creating cluster $KIND_CLUSTER_NAME: 1 control plane + $KIND_WORKERS workers from $image ($source; 2 cores: 2-5 min)"
created=true
if [[ $source == registry ]]; then
  "$KIND" create cluster --name "$KIND_CLUSTER_NAME" --image "$image" --config "$config" --wait 3m
else
  # kind's readiness wait needs a CNI, which only exists once cni.sh has run.
  "$KIND" create cluster --name "$KIND_CLUSTER_NAME" --image "$image" --config "$config"
  "$KIND_DIR/cni.sh"
  kind_progress "waiting for the nodes to be Ready"
  "$KUBECTL" --context "$KUBE_CONTEXT" wait --for=condition=Ready node --all --timeout=180s >/dev/null
  # The bridge plugin enforces no NetworkPolicy; kindnetd (which does) has no image here.
  if [[ ${KIND_NETWORK_POLICIES:-1} != 0 ]]; then "$KIND_DIR/network-policies.sh"
  else kind_progress "KIND_NETWORK_POLICIES=0: NetworkPolicies are not enforced"
  fi
fi
"$KUBECTL" --context "$KUBE_CONTEXT" get nodes -o wide
kind_progress "cluster $KIND_CLUSTER_NAME ready in $(( $(date +%s) - t0 ))s; next: make kind-install kind-demo"
