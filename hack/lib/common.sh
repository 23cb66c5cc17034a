# shellcheck shell=bash
# shellcheck disable=SC2034  # the settings are used by the files that source this one
# Shared settings and helpers for hack/local-cluster.sh. Sourced, never executed.
#
# Every knob is an environment variable so that the tests, a demo and a developer's
# shell can each run their own cluster side by side (different run dir and ports).

# shellcheck source=hack/versions.env
source "$HACK_DIR/versions.env"

CACHE_ROOT=${GPU_DRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-driver}
BIN_DIR=$CACHE_ROOT/bin/k8s-$K8S_VERSION-etcd-$ETCD_VERSION
SRC_DIR=$CACHE_ROOT/src
RUN_DIR=${GPU_DRA_CLUSTER_DIR:-${TMPDIR:-/tmp}/gpu-dra-local-cluster}
PKI_DIR=$RUN_DIR/pki
LOG_DIR=$RUN_DIR/logs
PID_DIR=$RUN_DIR/pids
KUBECONFIG_DIR=$RUN_DIR/kubeconfig
KUBECONFIG_FILE=$RUN_DIR/admin.kubeconfig
# A run dir is only ever deleted when it carries this marker (written by `up`).
RUN_MARKER=$RUN_DIR/.gpu-dra-local-cluster

API_PORT=${GPU_DRA_API_PORT:-6443}
ETCD_PORT=${GPU_DRA_ETCD_PORT:-2379}
ETCD_PEER_PORT=${GPU_DRA_ETCD_PEER_PORT:-2380}
KCM_PORT=${GPU_DRA_KCM_PORT:-10257}
SCHEDULER_PORT=${GPU_DRA_SCHEDULER_PORT:-10259}
SERVICE_CIDR=${GPU_DRA_SERVICE_CIDR:-10.96.0.0/16}
FIRST_SERVICE_IP=${GPU_DRA_FIRST_SERVICE_IP:-10.96.0.1}
SA_ISSUER=https://kubernetes.default.svc.cluster.local
# The apiserver refuses a loopback advertise address while its endpoint reconciler
# maintains the `kubernetes` Service endpoints ("may not be in the loopback range"), so
# with 127.0.0.1 the reconciler is off (type none) and that Service has no endpoints.
# A non-loopback address (e.g. a node bridge address) turns the lease reconciler on.
API_ADVERTISE_ADDRESS=${GPU_DRA_API_ADVERTISE_ADDRESS:-127.0.0.1}
# Readiness timeouts (seconds); a cold start on 2 cores takes about 20-40 s in total.
UP_TIMEOUT=${GPU_DRA_UP_TIMEOUT:-180}

CONTROL_PLANE_BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl)
# Start order; `down` stops them in reverse.
CONTROL_PLANE_COMPONENTS=(etcd kube-apiserver kube-controller-manager kube-scheduler)

# Feature gates, checked against pkg/features/kube_features.go of v1.37.1. Set here:
#   DRAPartitionableDevices   beta, on by default (pinned: beta defaults can change)
#   DRAConsumableCapacity     beta, on by default (pinned)
#   ResourceHealthStatus      beta, on by default (pinned; device health in pod status)
# Also needed by the driver, but GA in 1.37 and therefore not set: setting a GA gate
# logs "setting GA feature gate. It will be removed in a future release" and becomes an
# unknown-gate error once the gate is removed.
#   DRADeviceTaints, DRADeviceTaintRules  GA, on (locked from 1.38); DeviceTaintRule is
#                                         in resource.k8s.io/v1
#   DynamicResourceAllocation, DRAResourceClaimDeviceStatus, DRAAdminAccess,
#   DRAPrioritizedList                    GA, locked on
#   DRAExtendedResource                   GA, locked on (extended resources backed by a
#                                         DeviceClass: demo/12-extended-resources.yaml)
# tests/integration/test_control_plane.py checks every one of them through the
# apiserver's kubernetes_feature_enabled metric. The same string goes to every
# component (apiserver, controller-manager, scheduler, and the kubelet of node.sh).
FEATURE_GATES=DRAPartitionableDevices=true,DRAConsumableCapacity=true,ResourceHealthStatus=true
FEATURE_GATES+=${GPU_DRA_EXTRA_FEATURE_GATES:+,$GPU_DRA_EXTRA_FEATURE_GATES}
# resource.k8s.io/v1 (with devicetaintrules since 1.37) is on by default; it is listed
# so that the intent is explicit. v1beta1/v1beta2 are off by default in 1.37 and the
# driver does not use them; v1alpha3 only carries alpha APIs (ResourcePoolStatusRequest).
RUNTIME_CONFIG=${GPU_DRA_RUNTIME_CONFIG:-resource.k8s.io/v1=true}

START_TIME=$(date +%s)
elapsed() { printf '%s' "$(( $(date +%s) - START_TIME ))"; }
progress() { printf '[local-cluster %4ss] %s\n' "$(elapsed)" "$*"; }
die() { printf 'local-cluster: %s\n' "$*" >&2; exit 1; }

have_binaries() {
  local b
  for b in "$@"; do [[ -x $BIN_DIR/$b ]] || return 1; done
}

missing_binaries() {
  local b out=()
  for b in "$@"; do [[ -x $BIN_DIR/$b ]] || out+=("$b"); done
  printf '%s\n' "${out[@]}"
}

# True when something accepts TCP connections on 127.0.0.1:$1.
port_in_use() {
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# --- processes --------------------------------------------------------------------
# Each component is started in the background with its output in $LOG_DIR/<name>.log
# and its pid in $PID_DIR/<name>.pid. A pid only counts as ours while the process's
# command line still mentions $RUN_DIR (every component gets paths inside it), so a
# recycled pid is never signalled.

start_component() {
  local name=$1; shift
  mkdir -p "$LOG_DIR" "$PID_DIR"
  printf '\n=== %s: %s\n' "$(date -u +%FT%TZ)" "$*" >>"$LOG_DIR/$name.log"
  "$@" </dev/null >>"$LOG_DIR/$name.log" 2>&1 &
  printf '%s\n' "$!" >"$PID_DIR/$name.pid"
}

component_pid() {
  local f=$PID_DIR/$1.pid pid
  [[ -f $f ]] || return 1
  pid=$(<"$f")
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  printf '%s' "$pid"
}

# The pid from the pid file, if that process is alive and is really ours.
component_running() {
  local pid cmdline
  pid=$(component_pid "$1") || return 1
  kill -0 "$pid" 2>/dev/null || return 1
  cmdline=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
  [[ $cmdline == *"$RUN_DIR"* ]]
}

# stop_component <name>...: SIGTERM to each (together), SIGKILL after 10 s.
stop_component() {
  local name pid i names=() pids=()
  for name in "$@"; do
    if component_running "$name"; then
      pid=$(component_pid "$name")
      kill -TERM "$pid" 2>/dev/null || true
      names+=("$name"); pids+=("$pid")
    fi
  done
  for ((i = 0; i < ${#pids[@]}; i++)); do
    local waited
    for ((waited = 0; waited < 100; waited++)); do
      kill -0 "${pids[i]}" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "${pids[i]}" 2>/dev/null; then
      progress "${names[i]} (pid ${pids[i]}) ignored SIGTERM for 10 s; sending SIGKILL"
      kill -KILL "${pids[i]}" 2>/dev/null || true
    fi
    progress "stopped ${names[i]} (pid ${pids[i]})"
  done
  for name in "$@"; do rm -f "$PID_DIR/$name.pid"; done
}

show_log_tail() {
  local log=$LOG_DIR/$1.log
  [[ -f $log ]] || return 0
  printf -- '--- last 25 lines of %s ---\n' "$log" >&2
  tail -n 25 "$log" >&2
}

# wait_for <timeout s> <what> <component whose death aborts the wait> <command...>
wait_for() {
  local timeout=$1 what=$2 comp=$3 t0
  shift 3
  t0=$(date +%s)
  until "$@" >/dev/null 2>&1; do
    if [[ -n $comp ]] && ! component_running "$comp"; then
      show_log_tail "$comp"
      die "$comp exited while waiting for: $what (log: $LOG_DIR/$comp.log)"
    fi
    if (( $(date +%s) - t0 >= timeout )); then
      [[ -n $comp ]] && show_log_tail "$comp"
      die "timed out after ${timeout}s waiting for: $what${comp:+ (log: $LOG_DIR/$comp.log)}"
    fi
    sleep 0.5
  done
  progress "$what: ok after $(( $(date +%s) - t0 ))s"
}

kubectl_admin() {
  "$BIN_DIR/kubectl" --kubeconfig "$KUBECONFIG_FILE" "$@"
}
