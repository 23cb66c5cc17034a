# shellcheck shell=bash
# The real node of the local cluster (GPU_DRA_WITH_NODE=1 or `up --with-node`):
# containerd 2.x with CDI, runc, loopback-only CNI, and a kubelet with the DRA feature
# gates, registered with the control plane of hack/lib/control-plane.sh. Sourced by
# hack/local-cluster.sh, never executed.
#
# Networking, all of it local to this machine:
#   gpudra0     a port-less bridge holding two host addresses:
#               NODE_IP (10.87.0.1)     the node's InternalIP; the kubelet API listens
#                                        there, so the apiserver's logs/exec reach it
#               FIRST_SERVICE_IP (10.96.0.1) the `kubernetes` Service ClusterIP; a socat
#                                        process forwards :443 to the apiserver on
#                                        127.0.0.1, so in-cluster clients (the driver's
#                                        DaemonSet) work without kube-proxy
#   gdcni0      the CNI bridge, pods in 10.88.0.0/16. Pods get NO default route: only
#               the Service CIDR, routed to the host. Nothing leaves the machine.
#   blackhole   the rest of the Service CIDR, so no host process sends it to eth0.
#
# Fixed host paths (the Helm chart mounts them from the host): /var/lib/kubelet
# (plugins_registry, plugins, pods), /var/run/cdi and /etc/cdi. One node per machine.
# Everything else lives in $RUN_DIR/node.

# shellcheck source=hack/lib/node-build.sh
source "$HACK_DIR/lib/node-build.sh"
# shellcheck source=hack/lib/images.sh
source "$HACK_DIR/lib/images.sh"

NODE_NAME=${GPU_DRA_NODE_NAME:-gpu-dra-node}
NODE_DIR=$RUN_DIR/node
NODE_IP=${GPU_DRA_NODE_IP:-10.87.0.1}
NODE_HOST_BRIDGE=gpudra0
POD_BRIDGE=gdcni0
POD_CIDR=${GPU_DRA_POD_CIDR:-10.88.0.0/16}
CNI_NETWORK=gpu-dra-podnet
CNI_BIN_DIR=/usr/lib/cni
KUBELET_ROOT=/var/lib/kubelet
CDI_DIRS=(/etc/cdi /var/run/cdi)
CONTAINERD_SOCK=$NODE_DIR/containerd/containerd.sock
NODE_COMPONENTS=(containerd api-proxy kubelet)
NODE_MARKER=/run/gpu-dra-local-node # which run dir owns the node on this machine

ctr_node() { "$NODE_BIN_DIR/ctr" --address "$CONTAINERD_SOCK" --namespace k8s.io "$@"; }

# --- host ------------------------------------------------------------------------

# A node already running from another run dir (e.g. a demo cluster while the tests
# start their own) would share /var/lib/kubelet, port 10250 and the bridges.
check_node_owner() {
  [[ -f $NODE_MARKER ]] || return 0
  local owner
  owner=$(<"$NODE_MARKER")
  [[ $owner == "$RUN_DIR" ]] && return 0
  if [[ -d $owner && -f $owner/pids/kubelet.pid ]] && kill -0 "$(<"$owner/pids/kubelet.pid")" 2>/dev/null; then
    die "a local node is already running from run dir $owner (one node per machine): stop it with GPU_DRA_CLUSTER_DIR=$owner $0 down, or use that cluster (KUBECONFIG=$owner/admin.kubeconfig)"
  fi
  progress "node marker names $owner, which no longer runs a kubelet: taking over"
}

prepare_host() {
  # Mount propagation: the root mount is private on this machine (no systemd); the
  # kubelet and containerd need shared mounts for volumes with mountPropagation.
  if [[ $(findmnt -n -o PROPAGATION /) != shared* ]]; then
    mount --make-rshared /
    progress "made / a shared mount (mount propagation for the kubelet)"
  fi
  mkdir -p "$NODE_DIR" "$KUBELET_ROOT" "${CDI_DIRS[@]}" "$NODE_DIR/cni/net.d" "$NODE_DIR/pod-logs"
  # Host addresses on a port-less bridge (this kernel has no dummy interfaces).
  ip link show "$NODE_HOST_BRIDGE" >/dev/null 2>&1 || ip link add "$NODE_HOST_BRIDGE" type bridge
  ip addr replace "$NODE_IP/32" dev "$NODE_HOST_BRIDGE"
  ip addr replace "$FIRST_SERVICE_IP/32" dev "$NODE_HOST_BRIDGE"
  ip link set "$NODE_HOST_BRIDGE" up
  ip route replace blackhole "$SERVICE_CIDR"
  # CNI's host-local IPAM keeps allocations here; stale ones (a killed earlier run)
  # would leak addresses.
  rm -rf "/var/lib/cni/networks/$CNI_NETWORK"
  printf '%s\n' "$RUN_DIR" >"$NODE_MARKER"
}

write_cni_config() {
  cat >"$NODE_DIR/cni/net.d/10-$CNI_NETWORK.conflist" <<JSON
{
  "cniVersion": "1.0.0",
  "name": "$CNI_NETWORK",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$POD_BRIDGE",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$POD_CIDR"}]],
        "routes": [{"dst": "$SERVICE_CIDR"}]
      }
    }
  ]
}
JSON
}

write_containerd_config() {
  local d=$NODE_DIR/containerd
  mkdir -p "$d/root" "$d/state"
  cat >"$d/config.toml" <<TOML
# Written by hack/lib/node.sh; regenerated on every up.
version = 3
root = "$d/root"
state = "$d/state"
oom_score = 0

[grpc]
  address = "$CONTAINERD_SOCK"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  # Images come from ctr import only; nothing may be pulled.
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "$PAUSE_IMAGE"

[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = true
  cdi_spec_dirs = ["${CDI_DIRS[0]}", "${CDI_DIRS[1]}"]
  # No CAP_SYS_RESOURCE here: pods cannot get a lower oom_score_adj than containerd's.
  restrict_oom_score_adj = true
  disable_apparmor = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "$NODE_BIN_DIR/runc"
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["$CNI_BIN_DIR"]
    conf_dir = "$NODE_DIR/cni/net.d"
    max_conf_num = 1

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
TOML
}

# FEATURE_GATES "A=true,B=false" -> YAML map lines for the kubelet config.
feature_gates_yaml() {
  local kv
  IFS=',' read -ra kvs <<<"$FEATURE_GATES"
  for kv in "${kvs[@]}"; do
    [[ -n $kv ]] && printf '  %s: %s\n' "${kv%%=*}" "${kv#*=}"
  done
}

write_kubelet_config() {
  if [[ ! -f $PKI_DIR/kubelet-$NODE_NAME.crt ]]; then
    # The Node authorizer and NodeRestriction key on this identity.
    pki_cert ca "kubelet-$NODE_NAME" "/O=system:nodes/CN=system:node:$NODE_NAME" "$PKI_CLIENT_EXT"
    chmod 600 "$PKI_DIR/kubelet-$NODE_NAME.key"
  fi
  write_kubeconfig "$NODE_DIR/kubelet.kubeconfig" "system:node:$NODE_NAME" "kubelet-$NODE_NAME"
  cat >"$NODE_DIR/kubelet.yaml" <<YAML
# Written by hack/lib/node.sh; regenerated on every up.
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This machine has cgroup v1 (hybrid); since 1.35 the kubelet refuses it unless told.
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupsPerQOS: true
enforceNodeAllocatable: ["pods"]
failSwapOn: false
containerRuntimeEndpoint: unix://$CONTAINERD_SOCK
address: $NODE_IP
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI_DIR/ca.crt}
authorization: {mode: Webhook}
# The default -999 needs CAP_SYS_RESOURCE, which this machine does not grant.
oomScoreAdj: 0
protectKernelDefaults: false
# Pods get no DNS: the host's resolver is off limits.
resolvConf: ""
podLogsDir: $NODE_DIR/pod-logs
# Relaxed: a busy developer disk must not evict the test pods.
evictionHard:
  memory.available: "100Mi"
  nodefs.available: "1%"
  nodefs.inodesFree: "1%"
  imagefs.available: "1%"
# Image GC off: the imported images cannot be pulled again.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
maxPods: 110
nodeStatusUpdateFrequency: 5s
featureGates:
$(feature_gates_yaml)
YAML
}

# --- components -------------------------------------------------------------------

start_containerd() {
  start_component containerd env PATH="$NODE_BIN_DIR:$PATH" \
    "$NODE_BIN_DIR/containerd" --config "$NODE_DIR/containerd/config.toml" --log-level warn
}

containerd_ready() { ctr_node version; }

start_api_proxy() {
  # In-cluster clients use KUBERNETES_SERVICE_HOST:PORT = the kubernetes Service
  # (FIRST_SERVICE_IP:443); without kube-proxy this forwards it to the apiserver. The
  # apiserver certificate carries FIRST_SERVICE_IP as a SAN.
  # (-L: a lock file in $RUN_DIR, which also marks the process as ours.)
  rm -f "$PID_DIR/api-proxy.lock"
  start_component api-proxy socat -L "$PID_DIR/api-proxy.lock" \
    "TCP-LISTEN:443,bind=$FIRST_SERVICE_IP,reuseaddr,fork" \
    "TCP:127.0.0.1:$API_PORT,connect-timeout=5"
}

api_proxy_ready() {
  curl -sf --max-time 3 --cacert "$PKI_DIR/ca.crt" "https://$FIRST_SERVICE_IP/readyz" | grep -qx ok
}

start_kubelet() {
  start_component kubelet "$BIN_DIR/kubelet" \
    --config="$NODE_DIR/kubelet.yaml" \
    --kubeconfig="$NODE_DIR/kubelet.kubeconfig" \
    --root-dir="$KUBELET_ROOT" \
    --cert-dir="$NODE_DIR/kubelet-pki" \
    --hostname-override="$NODE_NAME" \
    --node-ip="$NODE_IP" \
    --v=1
}

kubelet_healthy() { curl -sf --max-time 3 http://127.0.0.1:10248/healthz | grep -qx ok; }

node_ready() {
  [[ $(kubectl_admin get node "$NODE_NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null) == True ]]
}

node_running() {
  local c
  for c in "${NODE_COMPONENTS[@]}"; do component_running "$c" || return 1; done
  kubelet_healthy
}

# --- up / down / status -----------------------------------------------------------

up_node() {
  local t0 c
  t0=$(date +%s)
  if ! have_runtime_binaries || ! have_binaries kubelet || [[ -n $(node_apt_missing) ]]; then
    progress "node components missing - building them first"
    cmd_build_node
  fi
  if node_running && node_ready; then
    progress "node $NODE_NAME already running; importing the images of this tree"
    ensure_images
    return
  fi
  check_node_owner
  for ((c = ${#NODE_COMPONENTS[@]} - 1; c >= 0; c--)); do stop_component "${NODE_COMPONENTS[c]}"; done
  cleanup_node_state
  port_in_use 10248 && die "127.0.0.1:10248 (kubelet healthz) is in use by a process this script did not start"
  prepare_host
  write_cni_config
  write_containerd_config
  write_kubelet_config

  trap on_up_exit EXIT
  start_containerd; UP_STARTED+=(containerd)
  wait_for 60 "containerd ready on $CONTAINERD_SOCK" containerd containerd_ready
  ensure_images
  start_api_proxy; UP_STARTED+=(api-proxy)
  wait_for 30 "kubernetes Service https://$FIRST_SERVICE_IP:443 -> apiserver" api-proxy api_proxy_ready
  start_kubelet; UP_STARTED+=(kubelet)
  wait_for 120 "kubelet healthy" kubelet kubelet_healthy
  wait_for "$UP_TIMEOUT" "node $NODE_NAME Ready" kubelet node_ready
  trap - EXIT
  progress "node $NODE_NAME up in $(( $(date +%s) - t0 ))s (kubelet $NODE_IP:10250, containerd $CONTAINERD_SOCK)"
}

# Pods' containers, their shims, network namespaces and mounts: everything the node
# leaves behind when the kubelet and containerd are gone (or were killed).
our_shim_pids() {
  local p cmd
  for p in /proc/[0-9]*; do
    cmd=$( { tr '\0' ' ' <"$p/cmdline"; } 2>/dev/null) || continue
    [[ $cmd == *containerd-shim-runc-v2*"$CONTAINERD_SOCK"* ]] && printf '%s\n' "${p#/proc/}"
  done
}

kill_node_containers() {
  containerd_ready >/dev/null 2>&1 || return 0
  local id n=0
  for id in $(ctr_node tasks ls -q 2>/dev/null); do
    ctr_node tasks kill --signal SIGKILL "$id" >/dev/null 2>&1 || true
    n=$((n + 1))
  done
  ((n == 0)) && return 0
  sleep 1
  for id in $(ctr_node tasks ls -q 2>/dev/null); do
    ctr_node tasks delete --force "$id" >/dev/null 2>&1 || true
  done
  progress "killed $n containers"
}

unmount_under() { # <dir>...
  local dir m
  for dir in "$@"; do
    [[ -d $dir ]] || continue
    # Deepest first.
    while read -r m; do
      umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
    done < <(findmnt -rn -o TARGET | awk -v d="$dir" 'index($0, d "/") == 1 || $0 == d' | sort -r)
  done
}

cleanup_node_state() {
  local pid n=0
  for pid in $(our_shim_pids); do
    kill -KILL "$pid" 2>/dev/null && n=$((n + 1))
  done
  ((n > 0)) && progress "killed $n leftover containerd shims"
  # Pod network namespaces created by CNI for our containerd.
  local ns
  for ns in /var/run/netns/cni-*; do
    [[ -e $ns ]] || continue
    umount "$ns" 2>/dev/null || umount -l "$ns" 2>/dev/null || true
    rm -f "$ns"
  done
  unmount_under "$NODE_DIR" "$KUBELET_ROOT/pods" "$KUBELET_ROOT/plugins" /run/containerd
  if [[ -d $KUBELET_ROOT ]]; then
    if [[ -n $(findmnt -rn -o TARGET | awk -v d="$KUBELET_ROOT/" 'index($0, d) == 1') ]]; then
      progress "warning: mounts remain under $KUBELET_ROOT; leaving it"
    else
      rm -rf "$KUBELET_ROOT"
    fi
  fi
  ip link show "$POD_BRIDGE" >/dev/null 2>&1 && ip link del "$POD_BRIDGE"
  rm -rf "/var/lib/cni/networks/$CNI_NETWORK"
  return 0
}

down_node() {
  [[ -d $NODE_DIR || -f $PID_DIR/kubelet.pid || -f $PID_DIR/containerd.pid ]] || return 0
  stop_component kubelet
  kill_node_containers
  stop_component containerd
  stop_component api-proxy
  cleanup_node_state
  # Leftover CDI specs of a driver that was never uninstalled belong to this node's
  # (now gone) pods.
  local f n=0
  for f in /var/run/cdi/*; do
    [[ -f $f ]] || continue
    [[ $(basename "$f") == k8s.*-gpu_*.json ]] && rm -f "$f" && n=$((n + 1))
  done
  ((n > 0)) && progress "removed $n leftover CDI specs from /var/run/cdi"
  if [[ -f $NODE_MARKER && $(<"$NODE_MARKER") == "$RUN_DIR" ]]; then
    ip link show "$NODE_HOST_BRIDGE" >/dev/null 2>&1 && ip link del "$NODE_HOST_BRIDGE"
    ip route del blackhole "$SERVICE_CIDR" 2>/dev/null || true
    rm -f "$NODE_MARKER"
  fi
  unmount_under "$NODE_DIR"
  progress "node $NODE_NAME stopped and cleaned up"
}

status_node() {
  [[ -d $NODE_DIR ]] || { printf '  node: not started (GPU_DRA_WITH_NODE=1 / up --with-node)\n'; return 0; }
  local c state ok=0
  for c in "${NODE_COMPONENTS[@]}"; do
    if component_running "$c"; then
      state="running (pid $(component_pid "$c"))"
    else
      state="not running"; ok=1
    fi
    printf '  %-24s %-22s log %s\n' "$c" "$state" "$LOG_DIR/$c.log"
  done
  if node_ready; then
    printf '  %-24s Ready (InternalIP %s)\n' "node/$NODE_NAME" "$NODE_IP"
  else
    printf '  %-24s not Ready\n' "node/$NODE_NAME"; ok=1
  fi
  return "$ok"
}
