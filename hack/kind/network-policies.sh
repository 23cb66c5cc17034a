#!/usr/bin/env bash
# NetworkPolicy enforcement for the offline kind cluster. Its pod network is Debian's
# bridge plugin (hack/kind/cni.sh), which enforces no NetworkPolicy; kind's own
# kindnetd enforces them with kube-network-policies, but its image cannot be built
# here. This runs the same implementation the way kindnetd does: one pod per node, host
# network, CAP_NET_ADMIN; the node sends the first packet of each new connection to an
# NFQUEUE, where the daemon decides from the policies, pods and namespaces it watches.
#
#   hack/kind/network-policies.sh [install]   build (cached), load the image into every
#                                             node, apply the DaemonSet, wait until its
#                                             daemon listens on the queue on every node
#                                             and the node steers traffic to the queue
#   hack/kind/network-policies.sh uninstall   delete the DaemonSet and its RBAC, wait for
#                                             its pods to go, and remove the steering
#                                             (the daemon's nftables table, which it
#                                             removes itself only on SIGINT, or the
#                                             iptables chain below) from every node
#   hack/kind/network-policies.sh --image     print the image name
#
# The binary: hack/build-kube-network-policies.sh (KUBE_NETWORK_POLICIES_* in
# hack/versions.env, from the Go module proxy). The image: that static binary alone, one
# layer (hack/lib/images.sh's oci_archive), cached by the binary's hash, loaded with
# `kind load image-archive`; imagePullPolicy Never, nothing is pulled.
#
# The daemon runs with --fail-open (as kindnetd configures it): while no daemon listens
# on the queue (a restart, `uninstall`), packets pass rather than cutting the plugin and
# the webhook off. The nodes' root user is never sent to the queue, which is how the
# kubelet's probes pass ("the pod's own node is always admitted").
set -euo pipefail
# shellcheck source=hack/kind/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# shellcheck source=hack/lib/images.sh
source "$HACK_DIR/lib/images.sh"

NP_NAME=gpu-dra-network-policies
NP_NAMESPACE=kube-system
NP_IMAGE=localhost/gpu-dra/kube-network-policies:v$KUBE_NETWORK_POLICIES_VERSION
# The daemon's table (its default name) and queue.
NP_TABLE=kube-network-policies
NP_QUEUE=100
NP_METRICS_PORT=9080

progress() { kind_progress "$@"; }
die() { kind_die "$@"; }
k() { "$KUBECTL" --context "$KUBE_CONTEXT" "$@"; }

cmd=${1:-install}
case $cmd in
  --image) printf '%s\n' "$NP_IMAGE"; exit 0 ;;
  install|uninstall) [[ $# -le 1 ]] || kind_die "usage: $0 [install|uninstall|--image]" ;;
  *) kind_die "usage: $0 [install|uninstall|--image]" ;;
esac

"$KIND" get clusters 2>/dev/null | has_line "$KIND_CLUSTER_NAME" ||
  kind_die "no kind cluster $KIND_CLUSTER_NAME: run make kind-up (hack/kind/create-cluster.sh) first"
mapfile -t nodes < <("$KIND" get nodes --name "$KIND_CLUSTER_NAME" | sort)

manifest() {
  cat <<YAML
apiVersion: v1
kind: ServiceAccount
metadata:
  name: $NP_NAME
  namespace: $NP_NAMESPACE
  labels: {app.kubernetes.io/name: $NP_NAME}
---
# What the daemon watches: the policies, the pods they select and admit (by labels and
# IPs), the namespaces of namespaceSelector peers, the nodes (only its admin policies,
# off here, use them); and the Events its recorder writes.
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: $NP_NAME
  labels: {app.kubernetes.io/name: $NP_NAME}
rules:
  - apiGroups: [""]
    resources: [pods, namespaces, nodes]
    verbs: [get, list, watch]
  - apiGroups: [networking.k8s.io]
    resources: [networkpolicies]
    verbs: [get, list, watch]
  - apiGroups: ["", events.k8s.io]
    resources: [events]
    verbs: [create, patch, update]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: $NP_NAME
  labels: {app.kubernetes.io/name: $NP_NAME}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: $NP_NAME}
subjects:
  - {kind: ServiceAccount, name: $NP_NAME, namespace: $NP_NAMESPACE}
---
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: $NP_NAME
  namespace: $NP_NAMESPACE
  labels: {app.kubernetes.io/name: $NP_NAME}
spec:
  selector:
    matchLabels: {app.kubernetes.io/name: $NP_NAME}
  updateStrategy: {type: RollingUpdate, rollingUpdate: {maxUnavailable: 100%}}
  template:
    metadata:
      labels: {app.kubernetes.io/name: $NP_NAME}
    spec:
      # The node's network namespace: its nftables ruleset and its NFQUEUE.
      hostNetwork: true
      serviceAccountName: $NP_NAME
      priorityClassName: system-node-critical
      # Every node, the control plane included.
      tolerations: [{operator: Exists}]
      terminationGracePeriodSeconds: 5
      containers:
        - name: kube-network-policies
          image: $NP_IMAGE
          imagePullPolicy: Never
          command:
            - /usr/local/bin/kube-network-policies
            - --hostname-override=\$(NODE_NAME)
            - --nfqueue-id=$NP_QUEUE
            - --fail-open
            - --metrics-bind-address=127.0.0.1:$NP_METRICS_PORT
            - --v=2
          env:
            - name: NODE_NAME
              valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
          # /metrics answers once the daemon has started; the install also waits for
          # it to listen on the queue.
          readinessProbe:
            httpGet: {host: 127.0.0.1, port: $NP_METRICS_PORT, path: /metrics}
            periodSeconds: 5
          resources:
            requests: {cpu: 20m, memory: 50Mi}
          securityContext:
            # nftables and NFQUEUE; not privileged. (No NRI socket is mounted: the
            # daemon learns pod IPs from the API server only.)
            capabilities: {add: [NET_ADMIN]}
YAML
}

# The image archive, keyed by the binary's hash: an unchanged binary is not re-archived.
image_archive() {
  local bin hash out work
  bin=$("$HACK_DIR/build-kube-network-policies.sh" | tail -n 1) ||
    kind_die "hack/build-kube-network-policies.sh failed"
  hash=$(sha256sum "$bin" | cut -c1-16)
  out=$IMAGES_DIR/kube-network-policies-v$KUBE_NETWORK_POLICIES_VERSION-$hash.oci.tar
  if [[ ! -f $out ]]; then
    kind_progress "image $NP_IMAGE: $(du -h "$bin" | cut -f1) static binary, one layer" >&2
    mkdir -p "$IMAGES_DIR"
    work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-dra-knp-image.XXXXXX")
    mkdir -p "$work/usr/local/bin"
    install -m 0755 "$bin" "$work/usr/local/bin/kube-network-policies"
    oci_archive "$work" "$NP_IMAGE" "$out" /usr/local/bin/kube-network-policies
    rm -rf "$work"
    find "$IMAGES_DIR" -maxdepth 1 -name 'kube-network-policies-*.oci.tar' ! -path "$out" -delete
  fi
  printf '%s\n' "$out"
}

node_has_image() { # <node>
  "$CONTAINER_TOOL" exec "$1" ctr -n k8s.io images ls -q 2>/dev/null | has_line "$NP_IMAGE"
}

# --- how packets reach the daemon's queue -----------------------------------------------
# The daemon writes an nftables table (inet kube-network-policies) whose postrouting
# chain accepts the node's root user and established connections and sends the rest of
# the traffic to or from the pods its policies select to NFQUEUE $NP_QUEUE. That needs
# the kernel's nftables `queue` expression (CONFIG_NFT_QUEUE). Where it is missing (this
# Firecracker kernel: `nft add rule ... queue num 100` answers "No such file or
# directory", and so does the daemon's whole table transaction), this script installs
# the same steering with iptables' NFQUEUE target (xt_NFQUEUE, with xt_owner and
# xt_conntrack) in the node's mangle POSTROUTING, for all pod traffic: chain $NP_CHAIN,
#   -m owner --uid-owner 0                      RETURN  (the node's root: the kubelet)
#   -m conntrack --ctstate ESTABLISHED,RELATED  RETURN
#   -s <pod CIDR> / -d <pod CIDR>               NFQUEUE --queue-num $NP_QUEUE --queue-bypass
# No rule drops anything: every verdict is the daemon's (it allows what no policy
# isolates), and without a daemon on the queue, --queue-bypass lets packets through.
NP_CHAIN=GPU-DRA-KNP

nft_queue_supported() { # <node>: the kernel has nftables' queue expression
  "$CONTAINER_TOOL" exec "$1" sh -c '
    nft add table inet gpu-dra-probe &&
    nft add chain inet gpu-dra-probe c "{ type filter hook postrouting priority 0; }" &&
    nft add rule inet gpu-dra-probe c ip daddr 192.0.2.1 queue num 65535 bypass
    rc=$?; nft delete table inet gpu-dra-probe 2>/dev/null; exit $rc' >/dev/null 2>&1
}

node_has_table() { # <node>: the daemon's own table with its queue rule
  local rules
  rules=$("$CONTAINER_TOOL" exec "$1" nft list table inet "$NP_TABLE" 2>/dev/null) || return 1
  grep -q "queue .*to $NP_QUEUE" <<<"$rules"
}

node_has_steering() { # <node>: this script's iptables chain with its NFQUEUE rules
  local rules
  rules=$("$CONTAINER_TOOL" exec "$1" iptables -t mangle -S "$NP_CHAIN" 2>/dev/null) || return 1
  grep -q -- "-j NFQUEUE --queue-num $NP_QUEUE" <<<"$rules"
}

node_queue_bound() { # <node>: a process listens on NFQUEUE $NP_QUEUE in the node
  "$CONTAINER_TOOL" exec "$1" cat /proc/net/netfilter/nfnetlink_queue 2>/dev/null |
    awk -v q="$NP_QUEUE" '$1 == q { found = 1 } END { exit !found }'
}

install_steering() { # <node> <pod CIDR>...
  local node=$1 cidr script
  shift
  script="iptables -t mangle -N $NP_CHAIN 2>/dev/null || iptables -t mangle -F $NP_CHAIN
iptables -t mangle -A $NP_CHAIN -m owner --uid-owner 0 -j RETURN
iptables -t mangle -A $NP_CHAIN -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN"
  for cidr in "$@"; do
    script+="
iptables -t mangle -A $NP_CHAIN -s $cidr -j NFQUEUE --queue-num $NP_QUEUE --queue-bypass
iptables -t mangle -A $NP_CHAIN -d $cidr -j NFQUEUE --queue-num $NP_QUEUE --queue-bypass"
  done
  script+="
iptables -t mangle -C POSTROUTING -j $NP_CHAIN 2>/dev/null || iptables -t mangle -A POSTROUTING -j $NP_CHAIN"
  "$CONTAINER_TOOL" exec "$node" sh -euc "$script" || kind_die "installing the NFQUEUE steering on $node failed"
}

remove_steering() { # <node>
  "$CONTAINER_TOOL" exec "$1" sh -c "
    while iptables -t mangle -D POSTROUTING -j $NP_CHAIN 2>/dev/null; do :; done
    iptables -t mangle -F $NP_CHAIN 2>/dev/null; iptables -t mangle -X $NP_CHAIN 2>/dev/null; true"
}

wait_nodes() { # <seconds> <what> <predicate>: until the predicate holds on every node
  local seconds=$1 what=$2 check=$3 pending=("${nodes[@]}") i node
  for ((i = 0; i < seconds && ${#pending[@]}; i++)); do
    local still=()
    for node in "${pending[@]}"; do "$check" "$node" || still+=("$node"); done
    pending=("${still[@]}")
    ((${#pending[@]} == 0)) || sleep 1
  done
  ((${#pending[@]} == 0)) || kind_die "$what not on ${pending[*]} after $seconds s"
}

np_install() {
  local t0 archive missing=() node how
  t0=$(date +%s)
  archive=$(image_archive)
  for node in "${nodes[@]}"; do node_has_image "$node" || missing+=("$node"); done
  if ((${#missing[@]})); then
    kind_progress "loading $NP_IMAGE into ${#missing[@]} nodes ($(du -h "$archive" | cut -f1))"
    "$KIND" load image-archive "$archive" --name "$KIND_CLUSTER_NAME" "${missing[@]/#/--nodes=}" >/dev/null
    for node in "${missing[@]}"; do
      node_has_image "$node" || kind_die "$NP_IMAGE is not in $node's containerd after kind load image-archive"
    done
  fi
  kind_progress "applying DaemonSet $NP_NAMESPACE/$NP_NAME (kube-network-policies v$KUBE_NETWORK_POLICIES_VERSION, hostNetwork, NET_ADMIN)"
  manifest | k apply -f - >/dev/null
  k -n "$NP_NAMESPACE" rollout status "daemonset/$NP_NAME" --timeout=120s >/dev/null ||
    { k -n "$NP_NAMESPACE" get pods -l "app.kubernetes.io/name=$NP_NAME" -o wide >&2
      kind_die "DaemonSet $NP_NAME not ready after 120 s"; }
  wait_nodes 60 "a kube-network-policies daemon bound to NFQUEUE $NP_QUEUE" node_queue_bound
  if nft_queue_supported "${nodes[0]}"; then
    # The daemon writes its table once its informers have synced.
    wait_nodes 60 "the nftables table inet $NP_TABLE" node_has_table
    how="the daemon's table inet $NP_TABLE"
  else
    local cidrs
    mapfile -t cidrs < <(k get nodes -o jsonpath='{range .items[*]}{.spec.podCIDR}{"\n"}{end}' | sort -u)
    ((${#cidrs[@]})) && [[ -n ${cidrs[0]} ]] || kind_die "no pod CIDRs on the nodes"
    kind_progress "this kernel has no nftables queue expression (CONFIG_NFT_QUEUE): steering pod traffic to NFQUEUE $NP_QUEUE with iptables (chain $NP_CHAIN in mangle POSTROUTING; pod CIDRs ${cidrs[*]})"
    for node in "${nodes[@]}"; do install_steering "$node" "${cidrs[@]}"; done
    wait_nodes 5 "the iptables chain $NP_CHAIN" node_has_steering
    how="iptables NFQUEUE steering, chain $NP_CHAIN"
  fi
  kind_progress "NetworkPolicies enforced on ${#nodes[@]} nodes ($how; queue $NP_QUEUE) in $(( $(date +%s) - t0 ))s"
}

np_uninstall() {
  local node
  kind_progress "deleting DaemonSet $NP_NAMESPACE/$NP_NAME and its RBAC"
  manifest | k delete -f - --ignore-not-found --wait=true --timeout=120s >/dev/null
  k -n "$NP_NAMESPACE" wait --for=delete pod -l "app.kubernetes.io/name=$NP_NAME" --timeout=120s >/dev/null 2>&1 || true
  for node in "${nodes[@]}"; do
    "$CONTAINER_TOOL" exec "$node" sh -c "nft list table inet $NP_TABLE >/dev/null 2>&1 && nft delete table inet $NP_TABLE || true"
    remove_steering "$node"
    ! node_has_table "$node" || kind_die "table inet $NP_TABLE still on $node"
    ! node_has_steering "$node" || kind_die "iptables chain $NP_CHAIN still on $node"
  done
  kind_progress "NetworkPolicies no longer enforced (no daemon, no steering rules on ${#nodes[@]} nodes)"
}

"np_$cmd"
