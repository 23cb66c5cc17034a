#!/usr/bin/env bash
# A real Kubernetes on this machine, without Docker: binaries built from upstream Go
# modules into a cache outside the repository, processes started on loopback.
#
#   hack/local-cluster.sh build    build (or reuse) etcd and the Kubernetes binaries
#   hack/local-cluster.sh up       start etcd + control plane, write an admin kubeconfig
#   hack/local-cluster.sh down     stop only the processes this script started
#   hack/local-cluster.sh status   show what runs and where
#   hack/local-cluster.sh env      print shell exports (KUBECONFIG, PATH) for the cluster
set -euo pipefail

HACK_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=hack/versions.env
source "$HACK_DIR/versions.env"

CACHE_ROOT=${GPU_DRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-driver}
BIN_DIR=$CACHE_ROOT/bin/k8s-$K8S_VERSION-etcd-$ETCD_VERSION
SRC_DIR=$CACHE_ROOT/src
RUN_DIR=${GPU_DRA_CLUSTER_DIR:-${TMPDIR:-/tmp}/gpu-dra-local-cluster}
PKI_DIR=$RUN_DIR/pki
LOG_DIR=$RUN_DIR/logs
PID_DIR=$RUN_DIR/pids
KUBECONFIG_FILE=$RUN_DIR/admin.kubeconfig
API_PORT=${GPU_DRA_API_PORT:-6443}
ETCD_PORT=${GPU_DRA_ETCD_PORT:-2379}
SERVICE_CIDR=10.96.0.0/16

CONTROL_PLANE_BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl)

FEATURE_GATES=DRADeviceTaints=true,DRADeviceTaintRules=true,DRAPartitionableDevices=true,DRAConsumableCapacity=true,DRAResourceClaimDeviceStatus=true,DRAAdminAccess=true,DRAPrioritizedList=true
RUNTIME_CONFIG=resource.k8s.io/v1beta1=true,resource.k8s.io/v1beta2=true,resource.k8s.io/v1alpha3=true,admissionregistration.k8s.io/v1beta1=true

START_TIME=$(date +%s)
progress() { printf '[local-cluster %4ss] %s\n' "$(( $(date +%s) - START_TIME ))" "$*"; }
die() { printf 'local-cluster: %s\n' "$*" >&2; exit 1; }

export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0

have_binaries() {
  local b
  for b in "$@"; do [[ -x $BIN_DIR/$b ]] || return 1; done
}

# Runs a long build in the background, printing elapsed time and the number of
# packages compiled so far, so that a cold build (tens of minutes) is visibly alive.
run_with_progress() {
  local label=$1 log=$2; shift 2
  "$@" >"$log" 2>&1 &
  local pid=$! last=0
  while kill -0 "$pid" 2>/dev/null; do
    sleep 5
    if (( $(date +%s) - last >= 30 )); then
      last=$(date +%s)
      progress "$label: $(grep -cv '^go: ' "$log" || true) packages compiled, last: $(tail -n 1 "$log" | cut -c1-80)"
    fi
  done
  if ! wait "$pid"; then
    tail -n 40 "$log" >&2
    die "$label failed; full log: $log"
  fi
}

version_ldflags() {
  local v=v$K8S_VERSION minor now pkg flags="-s -w"
  minor=$(cut -d. -f2 <<<"$K8S_VERSION")
  now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    flags+=" -X $pkg.gitVersion=$v -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    flags+=" -X $pkg.gitCommit=0000000000000000000000000000000000000000"
    flags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$now"
  done
  printf '%s' "$flags"
}

# k8s.io/kubernetes cannot be `go install`ed: it requires its staging modules at
# v0.0.0 through replace directives that Go ignores in a dependency. A wrapper module
# replaces each staging module with its published v0.<minor>.<patch> instead.
write_k8s_wrapper() {
  local dir=$1 gomod staging
  mkdir -p "$dir"
  gomod=$(go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  staging=$(grep -E '^\s*k8s\.io/[a-z0-9-]+ v0\.0\.0\s*$' "$gomod" | awk '{print $1}' | sort -u)
  {
    printf 'module local/k8sbin\n\ngo 1.26.0\n\nrequire k8s.io/kubernetes v%s\n\nreplace (\n' "$K8S_VERSION"
    local m
    for m in $staging; do printf '\t%s => %s v0.%s\n' "$m" "$m" "${K8S_VERSION#*.}"; done
    printf ')\n'
  } >"$dir/go.mod"
  printf 'package tools\n' >"$dir/doc.go"
}

build_k8s() {
  local wanted=("$@") pkgs=() b
  for b in "${wanted[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
  local dir=$SRC_DIR/k8s-$K8S_VERSION
  progress "resolving k8s.io/kubernetes v$K8S_VERSION modules (first time: downloads ~1 GB)"
  write_k8s_wrapper "$dir"
  (cd "$dir" && go mod download k8s.io/kubernetes) || die "module download failed"
  progress "compiling ${wanted[*]} (cold: 30-60 min on 2 cores; warm: a few minutes)"
  local tmp=$BIN_DIR.partial
  mkdir -p "$tmp"
  run_with_progress "kubernetes build" "$CACHE_ROOT/build-k8s.log" \
    bash -c "cd '$dir' && go build -v -trimpath -tags selinux,notest,grpcnotrace -ldflags '$(version_ldflags)' -o '$tmp/' ${pkgs[*]}"
  mkdir -p "$BIN_DIR"
  for b in "${wanted[@]}"; do mv "$tmp/$b" "$BIN_DIR/$b"; done
}

build_etcd() {
  local dir=$SRC_DIR/etcd-$ETCD_VERSION
  mkdir -p "$dir"
  printf 'module local/etcdbin\n\ngo 1.26.0\n\nrequire go.etcd.io/etcd/server/v3 v%s\n' "$ETCD_VERSION" >"$dir/go.mod"
  printf 'package tools\n' >"$dir/doc.go"
  progress "compiling etcd v$ETCD_VERSION"
  mkdir -p "$BIN_DIR"
  run_with_progress "etcd build" "$CACHE_ROOT/build-etcd.log" \
    bash -c "cd '$dir' && go build -v -trimpath -ldflags '-s -w' -o '$BIN_DIR/etcd.partial' go.etcd.io/etcd/server/v3"
  mv "$BIN_DIR/etcd.partial" "$BIN_DIR/etcd"
}

cmd_build() {
  mkdir -p "$CACHE_ROOT" "$SRC_DIR"
  command -v go >/dev/null || die "go is required to build the cluster binaries (go >= 1.26)"
  if have_binaries "${CONTROL_PLANE_BINARIES[@]}"; then
    progress "control-plane binaries cached in $BIN_DIR"
  else
    have_binaries etcd || build_etcd
    local missing=() b
    for b in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
      have_binaries "$b" || missing+=("$b")
    done
    ((${#missing[@]} == 0)) || build_k8s "${missing[@]}"
  fi
  "$BIN_DIR/kube-apiserver" --version | grep -q "v$K8S_VERSION" || die "kube-apiserver is not stamped v$K8S_VERSION"
  progress "build done: $(du -sh "$BIN_DIR" | cut -f1) of binaries in $BIN_DIR"
}

cmd_main() {
  case ${1:-} in
    build) cmd_build ;;
    bin-dir) printf '%s\n' "$BIN_DIR" ;;
    *) die "usage: $0 build|up|down|status|env|bin-dir" ;;
  esac
}

cmd_main "$@"
