#!/usr/bin/env bash
# Steps 2-5 of hack/kind/demo.sh (see there): the ValidatingAdmissionPolicy refusal, the
# webhook refusing an invalid GpuConfig, a permanent error, an Xid that evicts a pod.
# Exits non-zero when one does not happen; deletes the scenario namespaces and clears
# the mock Xid on the way out, whatever happened.
set -euo pipefail
# shellcheck source=hack/kind/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

[[ $# -eq 0 ]] || kind_die "usage: $0"
SCENARIOS=$REPO_DIR/demo/scenarios
k() { "$KUBECTL" --context "$KUBE_CONTEXT" "$@"; }
plugin_on() { # <node>: the plugin pod there
  k -n "$DRIVER_NAMESPACE" get pods -l app.kubernetes.io/component=kubeletplugin \
    --field-selector "spec.nodeName=$1,status.phase=Running" -o jsonpath='{.items[0].metadata.name}'
}
gpu_of() { # <namespace> <pod>: the first GPU_DEVICE_<n>=gpu-<n> line of its log
  k -n "$1" logs "$2" | sed -n 's/^GPU_DEVICE_[A-Z0-9_]*=\(gpu-[0-9]*\)$/\1/p' | head -n 1
}
taints_of() { # <node> <device>: the device's taints in that node's slices
  k get resourceslices --field-selector "spec.driver=$DRIVER_NAME,spec.nodeName=$1" -o json |
    python3 -c 'import json,sys; d=sys.argv[1]; print(" ".join("%s=%s:%s" % (t["key"], t.get("value", ""), t["effect"]) for s in json.load(sys.stdin)["items"] for x in s["spec"].get("devices") or [] if x["name"] == d for t in x.get("taints") or []))' "$2"
}
xid_node=
cleanup() {
  k delete namespace gpu-demo-permanent-error gpu-demo-xid --ignore-not-found --wait=false >/dev/null 2>&1 || true
  if [[ -n $xid_node ]]; then
    local pod
    pod=$(plugin_on "$xid_node" 2>/dev/null) &&
      k -n "$DRIVER_NAMESPACE" exec "$pod" -c plugin -- gpu-dra mock reset --all >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT
# A previous run's scenario namespaces may still be terminating.
for ns in gpu-demo-permanent-error gpu-demo-xid; do
  k wait --for=delete "namespace/$ns" --timeout=180s >/dev/null 2>&1 || true
done

workers=$(k get nodes -l '!node-role.kubernetes.io/control-plane' -o name | wc -l)
if ((workers >= 2)); then
  kind_progress "2. node-scoped ValidatingAdmissionPolicy ($workers workers, one plugin each)"
  "$KIND_DIR/vap-check.sh"
else
  kind_progress "2. (the ValidatingAdmissionPolicy check needs two workers: KIND_WORKERS=2)"
fi

kind_progress "3. the admission webhook: a claim with an invalid GpuConfig (server-side dry run)"
webhooks=$(k -n "$DRIVER_NAMESPACE" get deployment -l app.kubernetes.io/component=webhook -o name 2>/dev/null || true)
if [[ -n $webhooks ]]; then
  refusal=$(k apply --dry-run=server -f - 2>&1 <<YAML || true
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: invalid-config, namespace: default}
spec:
  devices:
    requests:
    - name: gpu
      exactly: {deviceClassName: $DRIVER_NAME}
    config:
    - requests: [gpu]
      opaque:
        driver: $DRIVER_NAME
        parameters:
          apiVersion: gpu.resource.example.com/v1alpha1
          kind: GpuConfig
          sharing: {strategy: TimeSlicing, timeSlicingConfig: {interval: Sometimes}}
YAML
)
  [[ $refusal == *"denied the request"*"unknown time-slice interval: 'Sometimes'"* ]] ||
    kind_die "the webhook did not refuse an invalid GpuConfig: $refusal"
  kind_progress "refused: ${refusal#*: admission webhook }"
else
  kind_progress "(no webhook installed: webhook.enabled=false)"
fi

kind_progress "4. permanent error: a claim asks for 64 partitions of a GPU (demo/scenarios/permanent-error.yaml)"
k apply -f "$SCENARIOS/permanent-error.yaml" >/dev/null
msg=
for _ in $(seq 120); do
  msg=$(k -n gpu-demo-permanent-error get events --field-selector reason=FailedPrepareDynamicResources \
    -o jsonpath='{.items[0].message}' 2>/dev/null || true)
  [[ -n $msg ]] && break
  sleep 1
done
[[ $msg == *"permanent (invalid-config)"* ]] ||
  kind_die "no FailedPrepareDynamicResources event with 'permanent (invalid-config)' (got: ${msg:-nothing})"
kind_progress "pod0 event FailedPrepareDynamicResources: $msg"
k -n gpu-demo-permanent-error get pod pod0 -o wide

kind_progress "5. Xid 79 on the GPU of a running Deployment pod (demo/scenarios/xid-eviction.yaml; xidTaintEffect NoExecute)"
k apply -f "$SCENARIOS/xid-eviction.yaml" >/dev/null
k -n gpu-demo-xid rollout status deployment/trainer --timeout=180s >/dev/null
old_pod=$(k -n gpu-demo-xid get pods -l app=gpu-demo-xid -o jsonpath='{.items[0].metadata.name}')
xid_node=$(k -n gpu-demo-xid get pod "$old_pod" -o jsonpath='{.spec.nodeName}')
gpu=$(gpu_of gpu-demo-xid "$old_pod")
[[ -n $gpu ]] || kind_die "pod $old_pod printed no GPU"
plugin=$(plugin_on "$xid_node")
kind_progress "pod $old_pod runs on $xid_node, $gpu; kubectl exec $plugin -- gpu-dra mock xid --device $gpu --xid 79"
k -n "$DRIVER_NAMESPACE" exec "$plugin" -c plugin -- gpu-dra mock xid --device "$gpu" --xid 79
taint=
for _ in $(seq 60); do
  taint=$(taints_of "$xid_node" "$gpu")
  [[ -n $taint ]] && break
  sleep 1
done
[[ -n $taint ]] || kind_die "no taint on $gpu of $xid_node after 60 s"
kind_progress "ResourceSlice of $xid_node: $gpu taints: $taint"
new_pod=
for _ in $(seq 180); do
  new_pod=$(k -n gpu-demo-xid get pods -l app=gpu-demo-xid --field-selector status.phase=Running \
    -o jsonpath='{range .items[*]}{.metadata.name} {.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' |
    awk -v old="$old_pod" '$1 != old && $2 == "True" {print $1; exit}')
  [[ -n $new_pod ]] && break
  sleep 1
done
[[ -n $new_pod ]] || { k -n gpu-demo-xid get pods,events >&2; kind_die "no replacement pod became Ready"; }
for _ in $(seq 60); do
  k -n gpu-demo-xid get pod "$old_pod" >/dev/null 2>&1 || break
  sleep 1
done
k -n gpu-demo-xid get pod "$old_pod" >/dev/null 2>&1 && kind_die "$old_pod still exists: not evicted"
new_node=$(k -n gpu-demo-xid get pod "$new_pod" -o jsonpath='{.spec.nodeName}')
new_gpu=$(gpu_of gpu-demo-xid "$new_pod")
evictions=$(k -n gpu-demo-xid get events --field-selector "involvedObject.name=$old_pod" \
  -o jsonpath='{range .items[*]}{.reason}: {.message}{"\n"}{end}' | grep -iE 'evict|taint' | head -n 2 | tr '\n' ' ' || true)
kind_progress "$old_pod evicted: ${evictions:-gone}"
kind_progress "replacement $new_pod runs on $new_node, $new_gpu (was $xid_node, $gpu)"
[[ "$new_node/$new_gpu" != "$xid_node/$gpu" ]] || kind_die "the replacement got the failed GPU $gpu of $xid_node"
k -n gpu-demo-xid get pods -o wide
kind_progress "clearing the mock Xid: gpu-dra mock reset --all (in $plugin)"
k -n "$DRIVER_NAMESPACE" exec "$plugin" -c plugin -- gpu-dra mock reset --all >/dev/null
xid_node=
kind_progress "demo done"
