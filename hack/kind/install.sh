#!/usr/bin/env bash
# Installs (or upgrades) the chart into the kind cluster with the mock NVML backend:
# deployments/helm/gpu-dra-driver/values-mock.yaml (the values file the integration
# tests use) and demo/values-demo.yaml on top (the mock fleet `make demo` runs its
# examples on: 22 GPUs per node; Xid taints with effect NoExecute), so that every
# demo/ example runs unchanged. KIND_DEMO_VALUES=0 leaves values-demo.yaml out. Extra
# arguments go to helm, e.g. --set webhook.enabled=false. Waits until every node's
# plugin has published its own pool.
set -euo pipefail
# shellcheck source=hack/kind/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

HELM=$(find_helm)
DEMO_VALUES=$REPO_DIR/demo/values-demo.yaml
values=(--values "$MOCK_VALUES")
# values-demo.yaml turns the admission webhook off for the local cluster, which has no
# kube-proxy; kind has one, so the API server reaches the webhook's Service: back on.
[[ ${KIND_DEMO_VALUES:-1} == 0 ]] || values+=(--values "$DEMO_VALUES" --set webhook.enabled=true)
kubectl() { "$KUBECTL" "$@"; }
repo=${DRIVER_IMAGE%:*}
tag=${DRIVER_IMAGE##*:}

# The chart's NetworkPolicies with peers (KIND_NETWORK_POLICIES=0: the chart's defaults,
# the plugin's policy admitting no pod, no webhook policy). The cluster enforces them:
# kindnetd on the registry node image, hack/kind/network-policies.sh on the offline one.
#   metrics port: a Prometheus in namespace monitoring (values.yaml's example peer);
#   webhook port: the API server, i.e. the control-plane node's address (the calls come
#     from the host network there; docs/security.md). With Podman also the container
#     network's gateway: netavark masquerades whatever leaves a container of its network
#     for an address outside the network's subnet, and with the host's bridge netfilter
#     on (br_netfilter's default) that includes a node's packets to another node's pod
#     CIDR, bridged between the two containers. So the API server's calls reach a webhook
#     pod on a worker from the gateway (the host), not from the control-plane node
#     (measured: the daemon's log shows 10.89.0.1, the webhook call times out). Pod-to-pod
#     traffic keeps its addresses (a pod CIDR source is not masqueraded).
if [[ ${KIND_NETWORK_POLICIES:-1} != 0 ]]; then
  api_ips=$(kubectl --context "$KUBE_CONTEXT" get nodes -l node-role.kubernetes.io/control-plane \
    -o jsonpath='{range .items[*]}{.status.addresses[?(@.type=="InternalIP")].address}{"\n"}{end}')
  [[ -n $api_ips ]] || kind_die "no InternalIP on the control-plane node(s) for webhook.networkPolicy.from"
  if [[ $CONTAINER_TOOL == podman ]]; then
    gateway=$(podman inspect "$KIND_CLUSTER_NAME-control-plane" \
      --format "{{(index .NetworkSettings.Networks \"$KIND_NETWORK\").Gateway}}")
    [[ $gateway =~ ^[0-9.]+$ ]] || kind_die "no IPv4 gateway of network $KIND_NETWORK on $KIND_CLUSTER_NAME-control-plane: '$gateway'"
    api_ips+=$'\n'$gateway
  fi
  peers=$(sed 's|.*|{"ipBlock":{"cidr":"&/32"}}|' <<<"$api_ips" | paste -sd, -)
  values+=(--set-json 'kubeletPlugin.metrics.networkPolicy.from=[{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"monitoring"}},"podSelector":{"matchLabels":{"app.kubernetes.io/name":"prometheus"}}}]'
    --set webhook.networkPolicy.enabled=true --set-json "webhook.networkPolicy.from=[$peers]")
fi

# The plugin pods need the privileged Pod Security level (host paths, root).
kubectl --context "$KUBE_CONTEXT" create namespace "$DRIVER_NAMESPACE" --dry-run=client -o yaml |
  kubectl --context "$KUBE_CONTEXT" apply -f - >/dev/null
kubectl --context "$KUBE_CONTEXT" label namespace "$DRIVER_NAMESPACE" --overwrite \
  pod-security.kubernetes.io/enforce=privileged >/dev/null

kind_progress "installing release $HELM_RELEASE ($CHART_DIR, $(printf '%s ' "${values[@]}" | sed 's/--values //g; s/--set-json //g; s/--set //g'), image $repo:$tag) in namespace $DRIVER_NAMESPACE"
"$HELM" upgrade --install "$HELM_RELEASE" "$CHART_DIR" \
  --kube-context "$KUBE_CONTEXT" \
  --namespace "$DRIVER_NAMESPACE" --create-namespace \
  "${values[@]}" \
  --set-string image.repository="$repo" --set-string image.tag="$tag" \
  --wait --timeout 5m "$@"

# The plugin runs on every worker (the chart does not tolerate the control plane's taint).
nodes=$(kubectl --context "$KUBE_CONTEXT" get nodes -l '!node-role.kubernetes.io/control-plane' \
  -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}')
[[ -n $nodes ]] || kind_die "the cluster has no worker node for the plugin (KIND_WORKERS=0?)"
kind_progress "waiting for the ResourceSlices of driver $DRIVER_NAME: one pool per worker ($(wc -l <<<"$nodes") workers)"
pools=
for _ in $(seq 90); do
  # Only this driver's slices count (another DRA driver's slices would pass a bare check).
  pools=$(kubectl --context "$KUBE_CONTEXT" get resourceslices --field-selector "spec.driver=$DRIVER_NAME" \
    -o jsonpath='{range .items[*]}{.spec.nodeName}{"\n"}{end}' 2>/dev/null | sort -u)
  if [[ $pools == "$(sort -u <<<"$nodes")" ]]; then
    kubectl --context "$KUBE_CONTEXT" -n "$DRIVER_NAMESPACE" get pods -o wide
    kind_progress "slices per node: $(kubectl --context "$KUBE_CONTEXT" get resourceslices --field-selector "spec.driver=$DRIVER_NAME" \
      -o jsonpath='{range .items[*]}{.spec.nodeName}{"\n"}{end}' | sort | uniq -c | awk '{printf "%s=%s ", $2, $1}')"
    kind_progress "installed; next: make kind-demo"
    exit 0
  fi
  sleep 2
done
kubectl --context "$KUBE_CONTEXT" -n "$DRIVER_NAMESPACE" get pods -o wide >&2
kind_die "after 180 s, slices of $DRIVER_NAME for nodes: ${pools:-none} (want every worker: $(tr '\n' ' ' <<<"$nodes")); see: kubectl -n $DRIVER_NAMESPACE logs -l app.kubernetes.io/component=kubeletplugin"
