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
#
# Ownership: $NODE_MARKER (/run/gpu-dra-local-node) records the run dir that owns the
# node, the host paths it uses and its pids; the kubelet root carries a stamp file
# (.gpu-dra-local-node). node_host_guard runs before anything is stopped, unmounted or
# deleted and refuses when the host has kubelet/containerd state that they do not prove
# is ours (docs/local-cluster.md, "Foreign node state").

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
CDI_DIRS=(/etc/cdi /var/run/cdi)
CONTAINERD_SOCK=$NODE_DIR/containerd/containerd.sock
NODE_COMPONENTS=(containerd api-proxy kubelet)
# Host paths and ports of the node, and what node_host_guard inspects. The defaults are
# the real ones; the overrides let tests/unit/test_node_guard.py plant a foreign tree in
# a temporary directory, and let a node run beside a kubelet that owns the defaults.
KUBELET_ROOT=${GPU_DRA_KUBELET_ROOT:-/var/lib/kubelet} # the chart mounts the default
KUBELET_PORT=${GPU_DRA_KUBELET_PORT:-10250}
KUBELET_HEALTHZ_PORT=${GPU_DRA_KUBELET_HEALTHZ_PORT:-10248}
KUBELET_PROCESS_NAME=${GPU_DRA_KUBELET_PROCESS_NAME:-kubelet} # comm or argv[0] basename
NODE_MARKER=${GPU_DRA_NODE_MARKER:-/run/gpu-dra-local-node}   # which run dir owns the node
KUBELET_ROOT_STAMP=$KUBELET_ROOT/.gpu-dra-local-node           # this kubelet root is ours
# Inspected and cleaned, never configured: containerd always puts pod network
# namespaces in /var/run/netns; a system containerd keeps its socket in /run/containerd
# (ours listens in the run dir and never mounts anything there).
NETNS_DIR=${GPU_DRA_NETNS_DIR:-/var/run/netns}
HOST_CONTAINERD_DIR=${GPU_DRA_HOST_CONTAINERD_DIR:-/run/containerd}
CNI_STATE_DIR=${GPU_DRA_CNI_STATE_DIR:-/var/lib/cni/networks} # host-local IPAM
NODE_HOST_GUARD_OK=0 # set by node_host_guard; cleanup_node_state refuses without it
NODE_OWN_NETNS=()    # the cni-* namespaces node_host_guard proved ours

ctr_node() { "$NODE_BIN_DIR/ctr" --address "$CONTAINERD_SOCK" --namespace k8s.io "$@"; }

# --- ownership --------------------------------------------------------------------
# $NODE_MARKER, written by prepare_host before it creates anything and rewritten with
# the pids once the node is up, removed by `down`:
#   run_dir=... kubelet_root=... containerd_dir=... containerd_sock=...
#   kubelet_port=... kubelet_healthz_port=... containerd_pid=... kubelet_pid=...
# A marker of an older version of this file holds only the run dir (one line); it
# stands for the default paths.

write_node_marker() {
  local tmp c pid
  mkdir -p "$(dirname "$NODE_MARKER")"
  tmp=$(mktemp "$NODE_MARKER.XXXXXX")
  {
    printf '# hack/lib/node.sh: the local node of this machine; hack/local-cluster.sh down removes it\n'
    printf 'run_dir=%s\n' "$RUN_DIR"
    printf 'kubelet_root=%s\n' "$KUBELET_ROOT"
    printf 'containerd_dir=%s\n' "$NODE_DIR/containerd"
    printf 'containerd_sock=%s\n' "$CONTAINERD_SOCK"
    printf 'kubelet_port=%s\n' "$KUBELET_PORT"
    printf 'kubelet_healthz_port=%s\n' "$KUBELET_HEALTHZ_PORT"
    for c in "${NODE_COMPONENTS[@]}"; do
      if component_running "$c"; then
        pid=$(component_pid "$c")
        printf '%s_pid=%s\n' "${c//-/_}" "$pid"
      fi
    done
  } >"$tmp"
  mv -f "$tmp" "$NODE_MARKER"
}

# node_marker_get <key>: the value recorded in $NODE_MARKER (status 1 if none).
node_marker_get() {
  [[ -f $NODE_MARKER ]] || return 1
  local line first=""
  while IFS= read -r line || [[ -n $line ]]; do
    [[ -z $line || $line == \#* ]] && continue
    [[ -z $first ]] && first=$line
    if [[ $line == "$1="* ]]; then
      printf '%s' "${line#*=}"
      return 0
    fi
  done <"$NODE_MARKER"
  [[ -n $first && $first != *=* ]] || return 1
  # The one-line marker of an older version: the run dir, default paths.
  case $1 in
    run_dir) printf '%s' "$first" ;;
    kubelet_root) printf '/var/lib/kubelet' ;;
    containerd_dir) printf '%s' "$first/node/containerd" ;;
    containerd_sock) printf '%s' "$first/node/containerd/containerd.sock" ;;
    *) return 1 ;;
  esac
}

# pid_runs_from <pid> <dir>: the process is alive and its command line names <dir>
# (every component gets paths inside its run dir), so a recycled pid never counts.
pid_runs_from() {
  [[ $1 =~ ^[0-9]+$ ]] || return 1
  local cmd
  cmd=$( { tr '\0' ' ' <"/proc/$1/cmdline"; } 2>/dev/null) || return 1
  [[ $cmd == *"$2"* ]]
}

# The pid of the kubelet of the run dir the marker names, if it still runs.
marker_kubelet_pid() {
  local owner pid=""
  owner=$(node_marker_get run_dir) || return 1
  pid=$(node_marker_get kubelet_pid) || pid=$( { cat "$owner/pids/kubelet.pid"; } 2>/dev/null) || return 1
  pid_runs_from "$pid" "$owner" || return 1
  printf '%s' "$pid"
}

# True when $NODE_MARKER proves that the node state on this machine was left by these
# scripts: it names this run dir, or a run dir whose kubelet no longer runs (a crashed
# or killed cluster; `up` takes over).
node_marker_ours() {
  local owner
  owner=$(node_marker_get run_dir) || return 1
  [[ -n $owner ]] || return 1
  [[ $owner == "$RUN_DIR" ]] && return 0
  ! marker_kubelet_pid >/dev/null
}

# One line on the marker, for messages.
node_marker_state() {
  local owner pid
  if ! owner=$(node_marker_get run_dir); then
    printf 'no node marker %s' "$NODE_MARKER"
  elif [[ $owner == "$RUN_DIR" ]]; then
    printf 'node marker %s names this run dir' "$NODE_MARKER"
  elif pid=$(marker_kubelet_pid); then
    printf 'node marker %s names run dir %s, whose kubelet (pid %s) still runs' "$NODE_MARKER" "$owner" "$pid"
  else
    printf 'node marker %s names run dir %s, which no longer runs a kubelet' "$NODE_MARKER" "$owner"
  fi
}

# A node already running from another run dir (e.g. a demo cluster while the tests
# start their own) would share /var/lib/kubelet, port 10250 and the bridges.
check_node_owner() {
  local owner
  owner=$(node_marker_get run_dir) || return 0
  [[ $owner == "$RUN_DIR" ]] && return 0
  if marker_kubelet_pid >/dev/null; then
    die "a local node is already running from run dir $owner (one node per machine): stop it with GPU_DRA_CLUSTER_DIR=$owner $0 down, or use that cluster (KUBECONFIG=$owner/admin.kubeconfig)"
  fi
  progress "node marker names $owner, which no longer runs a kubelet: taking over"
}

# --- the guard: foreign node state --------------------------------------------------
# node_host_guard <action>: 0 when nothing on the host contradicts the marker; else it
# prints what it found and how to proceed to stderr and returns 1, having changed
# nothing. It runs before anything is stopped, unmounted, deleted or killed (up_node,
# down_node), and cleanup_node_state runs only after it passed. Checked:
#   $KUBELET_ROOT           not empty, and neither stamped nor recorded in the marker
#   $NETNS_DIR/cni-*        no marker of ours; or in use by a process that is not a
#                           container of our containerd and not named in its metadata
#   $HOST_CONTAINERD_DIR    a containerd.sock, or mounts under it (ours has neither)
#   ports                   $KUBELET_HEALTHZ_PORT, $KUBELET_PORT listening, not our kubelet
#   processes               named $KUBELET_PROCESS_NAME, not our kubelet, in our mount
#                           or network namespace (a kind node's kubelet is neither)
#   the marker              names another run dir whose kubelet still runs

NODE_FOREIGN=()
node_foreign() { NODE_FOREIGN+=("$*"); }

mounts_under() { # <dir>: mount points at or below it
  findmnt -rn -o TARGET | awk -v d="$1" 'index($0, d "/") == 1 || $0 == d'
}

# Shims of our containerd (this run dir's, and that of a dead owner the marker names).
our_shim_pids() {
  local socks=("$CONTAINERD_SOCK") s p cmd
  if node_marker_ours && s=$(node_marker_get containerd_sock) && [[ $s != "$CONTAINERD_SOCK" ]]; then
    socks+=("$s")
  fi
  for p in /proc/[0-9]*; do
    cmd=$( { tr '\0' ' ' <"$p/cmdline"; } 2>/dev/null) || continue
    for s in "${socks[@]}"; do
      if [[ $cmd == *containerd-shim-runc-v2*"$s"* ]]; then
        printf '%s\n' "${p#/proc/}"
        break
      fi
    done
  done
}

our_kubelet_pid() {
  component_running kubelet || return 1
  component_pid kubelet
}

guard_marker() {
  local owner pid
  owner=$(node_marker_get run_dir) || return 0
  [[ $owner == "$RUN_DIR" ]] && return 0
  pid=$(marker_kubelet_pid) || return 0
  node_foreign "marker $NODE_MARKER: run dir $owner owns the node and its kubelet (pid $pid) still runs; stop it with GPU_DRA_CLUSTER_DIR=$owner hack/local-cluster.sh down"
}

guard_kubelet_root() { # <1 when the marker is ours>
  local root=$KUBELET_ROOT entries mounts n_mounts recorded=""
  [[ -e $root || -L $root ]] || return 0
  if [[ -L $root || ! -d $root ]]; then
    node_foreign "path $root: exists and is not a directory"
    return 0
  fi
  entries=$( { find "$root" -mindepth 1 -maxdepth 1 ! -name "$(basename "$KUBELET_ROOT_STAMP")" -printf '%f\n' 2>/dev/null |
    sort | head -n 6 | tr '\n' ' '; } || true)
  mounts=$(mounts_under "$root")
  n_mounts=$(grep -c . <<<"$mounts" || true)
  # Empty (e.g. an up that failed right after mkdir): nothing to lose.
  [[ -z $entries ]] && ((n_mounts == 0)) && return 0
  [[ -f $KUBELET_ROOT_STAMP ]] && return 0
  if (($1)); then
    recorded=$(node_marker_get kubelet_root) || recorded=""
    [[ $recorded == "$root" ]] && return 0
  fi
  local why
  why="no stamp $(basename "$KUBELET_ROOT_STAMP") in it"
  if [[ -n $recorded ]]; then
    why+=", and the node marker records kubelet root $recorded"
  else
    why+=", and $(node_marker_state)"
  fi
  node_foreign "path $root: a kubelet root that is not ours (contains: ${entries% }$( ((n_mounts > 0)) && printf '; %s mounts under it, e.g. %s' "$n_mounts" "$(head -n 1 <<<"$mounts")"); $why)"
}

guard_netns() { # <1 when the marker is ours>
  local f files=() name
  for f in "$NETNS_DIR"/cni-*; do
    [[ -e $f ]] && files+=("$f")
  done
  ((${#files[@]} > 0)) || return 0
  if ! (($1)); then
    for f in "${files[@]}"; do
      node_foreign "netns $f: a pod network namespace, and $(node_marker_state)"
    done
    return 0
  fi
  # Names our containerd recorded (sandbox metadata, task bundles); pids in each netns;
  # the parent of each pid; our shims.
  local dir known=" "
  for dir in "$NODE_DIR/containerd" "$(node_marker_get containerd_dir || true)"; do
    [[ -n $dir && -d $dir ]] || continue
    known+=$( { find "$dir/root/io.containerd.metadata.v1.bolt" "$dir/state" -maxdepth 5 \
      -name rootfs -prune -o \( -name meta.db -o -name config.json \) -type f -print0 2>/dev/null |
      xargs -0 -r grep -ahoE 'cni-[0-9a-f-]{8,}' 2>/dev/null | sort -u | tr '\n' ' '; } || true)
  done
  local -A ppid_of=() ns_pids=() shim=()
  local p pp stat rest ns ino users
  for p in $(our_shim_pids); do shim[$p]=1; done
  for p in /proc/[0-9]*; do
    { read -r stat <"$p/stat"; } 2>/dev/null || continue
    rest=${stat##*) }
    read -r _ pp _ <<<"$rest"
    ppid_of[${p#/proc/}]=$pp
  done
  while read -r p ns; do
    [[ $ns == net:\[*\] ]] || continue
    ns=${ns#net:[}
    ns=${ns%]}
    p=${p#/proc/}
    ns_pids[$ns]+="${p%/ns/net} "
  done < <(find /proc/[0-9]*/ns/net -maxdepth 0 -printf '%p %l\n' 2>/dev/null)
  for f in "${files[@]}"; do
    name=$(basename "$f")
    if [[ $known == *" $name "* ]]; then
      NODE_OWN_NETNS+=("$f")
      continue
    fi
    ino=$(stat -L -c %i "$f" 2>/dev/null) || ino=""
    users=""
    [[ -n $ino ]] || ino=none
    for p in ${ns_pids[$ino]:-}; do
      # A container of ours descends from one of our shims.
      local q=$p hops=0
      while [[ -n $q && $q != 0 && $q != 1 && -z ${shim[$q]:-} ]] && ((hops++ < 64)); do
        q=${ppid_of[$q]:-}
      done
      [[ -n $q && -n ${shim[$q]:-} ]] || users+="$p "
    done
    if [[ -z $users ]]; then
      NODE_OWN_NETNS+=("$f") # unused (our containers are gone), or only ours in it
    else
      local -a up
      read -ra up <<<"$users"
      p=${up[0]}
      for q in "${up[@]}"; do # a user-space process names it best
        if [[ -s /proc/$q/cmdline ]]; then p=$q; break; fi
      done
      node_foreign "netns $f: in use by ${#up[@]} process(es) that are not containers of our containerd, e.g. pid $p ($( { cat "/proc/$p/comm"; } 2>/dev/null || printf '?'))"
    fi
  done
}

# ss_owners <ss args...>: the processes ss -p names for the sockets it lists, as
# "name (pid N), ..." (only root sees other users' processes).
ss_owners() {
  { ss -Hp "$@" 2>/dev/null | grep -oE '\("[^"]*",pid=[0-9]+' |
    sed -E 's/\("([^"]*)",pid=([0-9]+)/\1 (pid \2)/' | sort -u | paste -sd, - | sed 's/,/, /g'; } || true
}

guard_ports() {
  local port what listen pids p ours kpid=""
  kpid=$(our_kubelet_pid) || kpid=""
  for port in "$KUBELET_HEALTHZ_PORT" "$KUBELET_PORT"; do
    what="kubelet API"
    [[ $port == "$KUBELET_HEALTHZ_PORT" ]] && what="kubelet healthz"
    if command -v ss >/dev/null; then
      listen=$(ss -Hltn "sport = :$port" 2>/dev/null | awk '{print $4}' | sort -u | paste -sd' ' -)
    else
      listen=""
      port_in_use "$port" && listen="127.0.0.1:$port"
    fi
    [[ -n $listen ]] || continue
    pids=$(ss -Hltnp "sport = :$port" 2>/dev/null | grep -oE 'pid=[0-9]+' | cut -d= -f2 | sort -u) || pids=""
    ours=0
    if [[ -n $kpid ]]; then
      ours=1
      # ss names the owners as root; without that, our running kubelet holds it.
      for p in $pids; do [[ $p == "$kpid" ]] || ours=0; done
    fi
    ((ours)) && continue
    local owners
    owners=$(ss_owners -ltn "sport = :$port")
    if [[ -n $owners ]]; then owners="by $owners"; else owners="owner not visible (ss -p needs root)"; fi
    node_foreign "port $port ($what): listening on $listen, $owners"
  done
}

guard_containerd() {
  local sock=$HOST_CONTAINERD_DIR/containerd.sock mounts n owners
  if [[ -e $sock || -S $sock ]]; then
    owners=$(ss_owners -xl src "$sock")
    node_foreign "socket $sock: a containerd this script did not start${owners:+ (held by $owners)}; ours listens on $CONTAINERD_SOCK"
  fi
  [[ -d $HOST_CONTAINERD_DIR ]] || return 0
  mounts=$(mounts_under "$HOST_CONTAINERD_DIR")
  n=$(grep -c . <<<"$mounts" || true)
  ((n == 0)) || node_foreign "path $HOST_CONTAINERD_DIR: $n mounts under it (e.g. $(head -n 1 <<<"$mounts")); our containerd never mounts there"
}

# A process in mount and network namespaces other than ours (a kind or other
# container node) sees its own /var/lib/kubelet and ports, not this host's.
in_other_node_namespaces() { # <proc dir>
  local mnt net
  mnt=$(readlink "$1/ns/mnt" 2>/dev/null) && net=$(readlink "$1/ns/net" 2>/dev/null) || return 1
  [[ $mnt != "$(readlink /proc/self/ns/mnt)" && $net != "$(readlink /proc/self/ns/net)" ]]
}

guard_kubelet_processes() {
  local p pid comm argv0 kpid="" mpid=""
  kpid=$(our_kubelet_pid) || kpid=""
  for p in /proc/[0-9]*; do
    pid=${p#/proc/}
    comm="" argv0=""
    { read -r comm <"$p/comm"; } 2>/dev/null || continue
    { IFS= read -r -d '' argv0 <"$p/cmdline"; } 2>/dev/null || true
    [[ $comm == "$KUBELET_PROCESS_NAME" || ${argv0##*/} == "$KUBELET_PROCESS_NAME" ]] || continue
    [[ $pid == "$kpid" ]] && continue
    in_other_node_namespaces "$p" && continue
    if [[ -z $mpid ]]; then mpid=$(marker_kubelet_pid) || mpid=-; fi
    [[ $pid == "$mpid" ]] && continue # reported by guard_marker
    local cmd
    cmd=$( { tr '\0' ' ' <"$p/cmdline"; } 2>/dev/null) || cmd=$argv0
    cmd=${cmd% }
    node_foreign "process $pid ($KUBELET_PROCESS_NAME): ${cmd:0:160}"
  done
}

# node_host_guard [<action> [<what was done>]]: the words of the refusal message.
node_host_guard() {
  local action=${1:-set up the node} done=${2:-Nothing was stopped, unmounted or deleted.}
  local marker_ok=0 item
  NODE_FOREIGN=()
  NODE_OWN_NETNS=()
  NODE_HOST_GUARD_OK=0
  node_marker_ours && marker_ok=1
  guard_marker
  guard_kubelet_root "$marker_ok"
  guard_netns "$marker_ok"
  guard_containerd
  guard_ports
  guard_kubelet_processes
  if ((${#NODE_FOREIGN[@]} == 0)); then
    NODE_HOST_GUARD_OK=1
    return 0
  fi
  {
    printf 'local-cluster: refusing to %s: this machine has node state that hack/local-cluster.sh did not create (%s):\n' "$action" "$(node_marker_state)"
    for item in "${NODE_FOREIGN[@]}"; do printf '  - %s\n' "$item"; done
    printf '%s To proceed, either:\n' "$done"
    printf '  - stop the other kubelet/containerd (e.g. systemctl stop kubelet containerd; kind, minikube or k3s: delete that cluster), or\n'
    printf '  - if these are leftovers nobody needs, remove them yourself: umount -R %s/pods %s/plugins; rm -rf %s; ip netns delete <name> for each namespace listed, or\n' "$KUBELET_ROOT" "$KUBELET_ROOT" "$KUBELET_ROOT"
    printf '  - give this node other directories and ports: GPU_DRA_KUBELET_ROOT=<dir> GPU_DRA_KUBELET_PORT=<port> GPU_DRA_KUBELET_HEALTHZ_PORT=<port> (the chart then needs kubeletPlugin.kubeletRegistrarDirectoryPath=<dir>/plugins_registry and kubeletPlugin.kubeletPluginsDirectoryPath=<dir>/plugins; make demo and the e2e tests assume the defaults), or use another machine.\n'
    printf 'hack/local-cluster.sh node-preflight repeats this check and changes nothing.\n'
  } >&2
  return 1
}

# --- host ------------------------------------------------------------------------

prepare_host() {
  # The marker before anything else: what this function creates from here on is ours.
  write_node_marker
  # Mount propagation: the root mount is private on this machine (no systemd); the
  # kubelet and containerd need shared mounts for volumes with mountPropagation.
  if [[ $(findmnt -n -o PROPAGATION /) != shared* ]]; then
    mount --make-rshared /
    progress "made / a shared mount (mount propagation for the kubelet)"
  fi
  mkdir -p "$NODE_DIR" "$KUBELET_ROOT" "${CDI_DIRS[@]}" "$NODE_DIR/cni/net.d" "$NODE_DIR/pod-logs"
  # Survives a reboot (which empties /run and so the marker): this tree is ours.
  printf '%s\n' "$RUN_DIR" >"$KUBELET_ROOT_STAMP"
  # Host addresses on a port-less bridge (this kernel has no dummy interfaces).
  ip link show "$NODE_HOST_BRIDGE" >/dev/null 2>&1 || ip link add "$NODE_HOST_BRIDGE" type bridge
  ip addr replace "$NODE_IP/32" dev "$NODE_HOST_BRIDGE"
  ip addr replace "$FIRST_SERVICE_IP/32" dev "$NODE_HOST_BRIDGE"
  ip link set "$NODE_HOST_BRIDGE" up
  ip route replace blackhole "$SERVICE_CIDR"
  # CNI's host-local IPAM keeps allocations here; stale ones (a killed earlier run)
  # would leak addresses.
  rm -rf "${CNI_STATE_DIR:?}/$CNI_NETWORK"
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
  kep5322_feature_gate_yaml
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
port: $KUBELET_PORT
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $KUBELET_HEALTHZ_PORT
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
  start_component kubelet "$(node_kubelet_binary)" \
    --config="$NODE_DIR/kubelet.yaml" \
    --kubeconfig="$NODE_DIR/kubelet.kubeconfig" \
    --root-dir="$KUBELET_ROOT" \
    --cert-dir="$NODE_DIR/kubelet-pki" \
    --hostname-override="$NODE_NAME" \
    --node-ip="$NODE_IP" \
    --v=1
}

kubelet_healthy() { curl -sf --max-time 3 "http://127.0.0.1:$KUBELET_HEALTHZ_PORT/healthz" | grep -qx ok; }

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
  # Before anything is stopped, unmounted or deleted.
  node_host_guard "set up the node" || exit 1
  for ((c = ${#NODE_COMPONENTS[@]} - 1; c >= 0; c--)); do stop_component "${NODE_COMPONENTS[c]}"; done
  cleanup_node_state
  if port_in_use "$KUBELET_HEALTHZ_PORT"; then
    die "127.0.0.1:$KUBELET_HEALTHZ_PORT (kubelet healthz) is in use by a process this script did not start"
  fi
  kep5322_kubelet_prepare
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
  write_node_marker # now with the pids
  wait_for "$UP_TIMEOUT" "node $NODE_NAME Ready" kubelet node_ready
  trap - EXIT
  progress "node $NODE_NAME up in $(( $(date +%s) - t0 ))s (kubelet $NODE_IP:$KUBELET_PORT, containerd $CONTAINERD_SOCK)"
}

# The kubelet alone restarts (running containers stay, as with systemctl restart
# kubelet): the fault the e2e tier injects to check re-registration and idempotency.
restart_kubelet() {
  node_running || die "the node is not running (hack/local-cluster.sh up --with-node)"
  local t0
  t0=$(date +%s)
  if [[ -n ${GPU_DRA_KEP5322_KUBELET:-} ]]; then
    # Set: switch kubelets (1: the KEP-5322 prototype, 0: upstream); unset: the same.
    kep5322_kubelet_prepare
    write_kubelet_config
  fi
  stop_component kubelet
  start_kubelet
  wait_for 120 "kubelet healthy" kubelet kubelet_healthy
  write_node_marker # the new kubelet pid
  wait_for "$UP_TIMEOUT" "node $NODE_NAME Ready" kubelet node_ready
  progress "kubelet restarted in $(( $(date +%s) - t0 ))s"
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
    done < <(mounts_under "$dir" | sort -r)
  done
}

# Pods' containers, their shims, network namespaces and mounts: everything the node
# leaves behind when the kubelet and containerd are gone (or were killed). Only after
# node_host_guard passed; our own processes have been stopped by then.
cleanup_node_state() {
  ((NODE_HOST_GUARD_OK)) || die "internal error: cleanup_node_state without a passing node_host_guard"
  stop_node_leftovers
  # Pod network namespaces of our containerd (node_host_guard listed them).
  local ns
  for ns in "${NODE_OWN_NETNS[@]}"; do
    [[ -e $ns ]] || continue
    umount "$ns" 2>/dev/null || umount -l "$ns" 2>/dev/null || true
    rm -f "$ns"
  done
  unmount_under "$KUBELET_ROOT/pods" "$KUBELET_ROOT/plugins"
  if [[ -d $KUBELET_ROOT ]]; then
    if [[ -n $(mounts_under "$KUBELET_ROOT") ]]; then
      progress "warning: mounts remain under $KUBELET_ROOT; leaving it"
    else
      rm -rf "$KUBELET_ROOT"
    fi
  fi
  if ip link show "$POD_BRIDGE" >/dev/null 2>&1; then ip link del "$POD_BRIDGE"; fi
  rm -rf "${CNI_STATE_DIR:?}/$CNI_NETWORK"
  return 0
}

# What is ours by construction, whatever else the host holds: the shims of our
# containerd (their command line names its socket) and the mounts under the run dir.
stop_node_leftovers() {
  local pid n=0
  for pid in $(our_shim_pids); do
    kill -KILL "$pid" 2>/dev/null && n=$((n + 1))
  done
  ((n > 0)) && progress "killed $n leftover containerd shims"
  unmount_under "$NODE_DIR"
}

NODE_DOWN_INCOMPLETE=0 # set by down_node when node_host_guard refused; `down` exits 1
down_node() {
  [[ -d $NODE_DIR || -f $PID_DIR/kubelet.pid || -f $PID_DIR/containerd.pid ]] || return 0
  # Before anything is stopped, unmounted or deleted. On a refusal `down` still stops
  # this run dir's own processes and unmounts what lies under the run dir.
  if ! node_host_guard "clean up the node's host state" \
    "Only this run dir's own processes and the mounts under $NODE_DIR are stopped and unmounted; nothing else is touched."; then
    # shellcheck disable=SC2034  # read by cmd_down (hack/local-cluster.sh)
    NODE_DOWN_INCOMPLETE=1
    stop_component kubelet
    kill_node_containers
    stop_component containerd
    stop_component api-proxy
    stop_node_leftovers
    progress "node $NODE_NAME stopped; its host state was left alone (see above)"
    return 0
  fi
  stop_component kubelet
  kill_node_containers
  stop_component containerd
  stop_component api-proxy
  cleanup_node_state
  # Leftover CDI specs of a driver that was never uninstalled belong to this node's
  # (now gone) pods.
  local f n=0
  for f in "${CDI_DIRS[1]}"/*; do
    [[ -f $f ]] || continue
    [[ $(basename "$f") == k8s.*-gpu_*.json ]] && rm -f "$f" && n=$((n + 1))
  done
  ((n > 0)) && progress "removed $n leftover CDI specs from ${CDI_DIRS[1]}"
  if [[ $(node_marker_get run_dir || true) == "$RUN_DIR" ]]; then
    if ip link show "$NODE_HOST_BRIDGE" >/dev/null 2>&1; then ip link del "$NODE_HOST_BRIDGE"; fi
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
  if kep5322_choice binary >/dev/null; then
    printf '  %-24s %s (%s=%s)\n' "kubelet binary" "$(node_kubelet_binary)" "$KEP5322_GATE" "$(kep5322_choice gate)"
  fi
  if node_ready; then
    printf '  %-24s Ready (InternalIP %s)\n' "node/$NODE_NAME" "$NODE_IP"
  else
    printf '  %-24s not Ready\n' "node/$NODE_NAME"; ok=1
  fi
  return "$ok"
}
