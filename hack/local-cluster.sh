#!/usr/bin/env bash
# A real Kubernetes on this machine, without Docker: binaries built from upstream Go
# modules into a cache outside the repository, processes started on loopback.
#
#   hack/local-cluster.sh build    build (or reuse) etcd and the Kubernetes binaries
#   hack/local-cluster.sh up       start etcd + control plane, write an admin kubeconfig
#                                  (builds first when binaries are missing; idempotent)
#   hack/local-cluster.sh up --with-node   also the real node (same as GPU_DRA_WITH_NODE=1;
#                                  `build` with GPU_DRA_WITH_NODE=1 builds its binaries)
#   hack/local-cluster.sh up --with-node --kep5322-kubelet   the node runs the KEP-5322
#                                  prototype kubelet (same as GPU_DRA_KEP5322_KUBELET=1;
#                                  docs/kep-5322.md)
#   hack/local-cluster.sh down     stop only the processes this script started, remove
#                                  the run dir (GPU_DRA_KEEP_RUN_DIR=1 keeps it); exit 1
#                                  when the node's host state was left alone (foreign)
#   hack/local-cluster.sh node-preflight   check the host for kubelet/containerd state
#                                  that these scripts did not create (what `up
#                                  --with-node` refuses on); changes nothing
#   hack/local-cluster.sh restart-kubelet   restart the node's kubelet alone (containers keep running)
#                                  (with GPU_DRA_KEP5322_KUBELET=1 or 0 set: as the KEP-5322
#                                  prototype or the upstream kubelet)
#   hack/local-cluster.sh status   show what runs and where (exit 1 if not all healthy)
#   hack/local-cluster.sh running-node  print the run dir of the cluster whose node runs
#                                  on this machine (one node per machine; e.g. the demo's),
#                                  exit 1 when none runs
#   hack/local-cluster.sh env      print shell exports (KUBECONFIG, PATH) for the cluster
#   hack/local-cluster.sh bin-dir  print the directory of the cached binaries
#   hack/local-cluster.sh driver-image-tag  print the tag (src-<hash of the driver
#                                  sources>) `up --with-node` imported the driver image as
#                                  (recorded in the run dir; this tree's if none was)
#
# Environment (defaults in brackets):
#   GPU_DRA_CLUSTER_DIR      run dir: pki, kubeconfigs, logs, pids, etcd data
#                            [${TMPDIR:-/tmp}/gpu-dra-local-cluster]
#   GPU_DRA_API_PORT [6443]  GPU_DRA_ETCD_PORT [2379]  GPU_DRA_ETCD_PEER_PORT [2380]
#   GPU_DRA_KCM_PORT [10257] GPU_DRA_SCHEDULER_PORT [10259]
#   GPU_DRA_CACHE            binary/source cache [~/.cache/gpu-dra-driver]
#   GPU_DRA_WITH_NODE=1      also start a real kubelet node (hack/lib/node.sh: up_node,
#                            down_node, status_node)
#   GPU_DRA_KEP5322_KUBELET=1  the node's kubelet is the KEP-5322 prototype
#                            (hack/build-kubelet-kep5322.sh), with the gate
#                            DRAHandlePermanentDriverFailures=GPU_DRA_KEP5322_GATE [true]
#   GPU_DRA_EXTRA_FEATURE_GATES, GPU_DRA_RUNTIME_CONFIG, GPU_DRA_KCM_CONTROLLERS,
#   GPU_DRA_UP_TIMEOUT [180]
#   node host paths and ports [real ones]: GPU_DRA_KUBELET_ROOT [/var/lib/kubelet],
#   GPU_DRA_KUBELET_PORT [10250], GPU_DRA_KUBELET_HEALTHZ_PORT [10248]; only inspected,
#   for tests: GPU_DRA_NODE_MARKER [/run/gpu-dra-local-node], GPU_DRA_NETNS_DIR
#   [/var/run/netns], GPU_DRA_HOST_CONTAINERD_DIR [/run/containerd],
#   GPU_DRA_CNI_STATE_DIR [/var/lib/cni/networks], GPU_DRA_KUBELET_PROCESS_NAME [kubelet]
# docs/local-cluster.md has timings and troubleshooting.
set -euo pipefail

HACK_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=hack/lib/common.sh
source "$HACK_DIR/lib/common.sh"
# shellcheck source=hack/lib/build.sh
source "$HACK_DIR/lib/build.sh"
# shellcheck source=hack/lib/control-plane.sh
source "$HACK_DIR/lib/control-plane.sh"
if [[ -f $HACK_DIR/lib/node.sh ]]; then
  # shellcheck source=/dev/null
  source "$HACK_DIR/lib/node.sh"
fi

# The ports a running cluster in $RUN_DIR was started with win over the environment.
load_recorded_ports() {
  [[ -f $RUN_DIR/ports.env ]] || return 0
  local key value
  while IFS='=' read -r key value; do
    case $key in
      GPU_DRA_API_PORT) API_PORT=$value ;;
      GPU_DRA_ETCD_PORT) ETCD_PORT=$value ;;
      GPU_DRA_ETCD_PEER_PORT) ETCD_PEER_PORT=$value ;;
      GPU_DRA_KCM_PORT) KCM_PORT=$value ;;
      GPU_DRA_SCHEDULER_PORT) SCHEDULER_PORT=$value ;;
    esac
  done <"$RUN_DIR/ports.env"
}

node_wanted() { [[ ${GPU_DRA_WITH_NODE:-0} == 1 ]]; }

cmd_up() {
  load_recorded_ports # a run dir that has run keeps its ports (e.g. the demo's, borrowed)
  if ! have_binaries "${CONTROL_PLANE_BINARIES[@]}"; then
    progress "missing in $BIN_DIR: $(missing_binaries "${CONTROL_PLANE_BINARIES[@]}" | tr '\n' ' ')- building first"
    cmd_build
  fi
  up_control_plane
  if node_wanted; then
    declare -F up_node >/dev/null || die "GPU_DRA_WITH_NODE=1 but hack/lib/node.sh (up_node) is missing"
    up_node
  fi
  progress "ready; use it with: eval \"\$($0 env)\""
}

cmd_down() {
  load_recorded_ports
  if declare -F down_node >/dev/null; then down_node; fi
  down_control_plane
  if [[ ${GPU_DRA_KEEP_RUN_DIR:-0} == 1 ]]; then
    progress "kept $RUN_DIR"
  elif [[ -f $RUN_MARKER ]]; then
    rm -rf "$RUN_DIR"
    progress "removed $RUN_DIR"
  elif [[ -e $RUN_DIR ]]; then
    progress "left $RUN_DIR alone: it has no $(basename "$RUN_MARKER") marker"
  fi
  if [[ ${NODE_DOWN_INCOMPLETE:-0} == 1 ]]; then
    die "down left the node's host state alone: foreign node state (listed above)"
  fi
}

cmd_status() {
  load_recorded_ports
  printf 'local cluster: Kubernetes v%s, etcd v%s\n' "$K8S_VERSION" "$ETCD_VERSION"
  printf '  binaries   %s\n  run dir    %s\n  kubeconfig %s\n' "$BIN_DIR" "$RUN_DIR" "$KUBECONFIG_FILE"
  local rc=0
  status_control_plane || rc=1
  if declare -F status_node >/dev/null; then status_node || rc=1; fi
  return "$rc"
}

cmd_env() {
  # shellcheck disable=SC2016  # $PATH is expanded by the shell that evals this
  printf 'export KUBECONFIG=%q PATH=%q:"$PATH"\n' "$KUBECONFIG_FILE" "$BIN_DIR"
}

cmd_main() {
  case ${1:-} in
    build)
      cmd_build
      if node_wanted; then cmd_build_node; fi
      if [[ ${GPU_DRA_KEP5322_KUBELET:-0} == 1 ]]; then "$HACK_DIR/build-kubelet-kep5322.sh" >/dev/null; fi
      ;;
    up)
      [[ ${2:-} == --with-node ]] && export GPU_DRA_WITH_NODE=1
      if [[ ${3:-} == --kep5322-kubelet ]]; then export GPU_DRA_KEP5322_KUBELET=1; fi
      if [[ ${2:-} == --kep5322-kubelet ]]; then die "--kep5322-kubelet is an option of the node: up --with-node --kep5322-kubelet"; fi
      cmd_up
      ;;
    down) cmd_down ;;
    node-preflight)
      declare -F node_host_guard >/dev/null || die "hack/lib/node.sh is missing"
      if ! node_host_guard "set up the node"; then exit 1; fi
      progress "no foreign node state: $(node_marker_state)"
      ;;
    restart-kubelet)
      declare -F restart_kubelet >/dev/null || die "hack/lib/node.sh is missing"
      load_recorded_ports
      restart_kubelet
      ;;
    status) cmd_status ;;
    running-node)
      declare -F marker_kubelet_pid >/dev/null || die "hack/lib/node.sh is missing"
      owner=$(node_marker_get run_dir) && marker_kubelet_pid >/dev/null || exit 1
      printf '%s\n' "$owner"
      ;;
    env) cmd_env ;;
    bin-dir) printf '%s\n' "$BIN_DIR" ;;
    driver-image-tag)
      declare -F imported_driver_image_tag >/dev/null || die "hack/lib/images.sh is missing"
      imported_driver_image_tag
      printf '\n'
      ;;
    *) die "usage: $0 build|up [--with-node [--kep5322-kubelet]]|down|restart-kubelet|status|running-node|env|bin-dir|driver-image-tag|node-preflight" ;;
  esac
}

cmd_main "$@"
