#!/usr/bin/env bash
# `make demo`: the whole user story on this machine, from nothing.
#   1. build what is missing (control plane, kubelet, containerd, runc, helm, images)
#   2. start the local cluster with its real node (hack/local-cluster.sh up --with-node)
#   3. helm install the driver (mock GPUs) as a DaemonSet on that node
#   4. demo/partitions/: the driver upgraded to reference partitions for the
#      partition-sharing example, then back to the demo values
#   5. demo/mps/: the driver upgraded to run MPS daemons; two shares of one GPU, each
#      limited by a daemon of its own; then back to the demo values
#   5b. demo/mps/strict-partitions.yaml: two partitions of one GPU under one MPS
#      server in EXCLUSIVE_PROCESS (--mps-strict-partitions); then back again
#   6. apply demo/[0-9]*.yaml, print per pod and container the GPUs it sees (the
#      GPU_DEVICE_* variables CDI put into the container environment)
#   7. the permanent-error scenario (KEP-5322) and the Xid/NoExecute scenario; the
#      permanent error twice: on today's kubelet (retrying) and on the KEP-5322
#      prototype kubelet (hack/patches/, docs/kep-5322.md), which fails the pod at once
# The cluster stays up afterwards; `hack/local-cluster.sh down` stops it. The demo's
# cluster-scoped objects (the DeviceTaintRule of 10-device-taints.yaml) are deleted when
# the demo ends, so that no GPU stays tainted for later users.
#
# Environment: GPU_DRA_DEMO_KEEP=1 leaves the example namespaces in place (default:
# they stay too; GPU_DRA_DEMO_CLEAN=1 deletes them at the end). Every setting of
# hack/local-cluster.sh applies (GPU_DRA_CLUSTER_DIR, ports, ...).
set -euo pipefail

DEMO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$DEMO_DIR/.." && pwd)
CLUSTER=$REPO/hack/local-cluster.sh
CHART=$REPO/deployments/helm/gpu-dra-driver
RELEASE="gpu-dra-driver"
DRIVER_NS="gpu-dra-driver"
export GPU_DRA_WITH_NODE=1

START=$(date +%s)
step() { printf '\n\033[1m[demo %4ss] == %s\033[0m\n' "$(( $(date +%s) - START ))" "$*"; }
say() { printf '[demo %4ss] %s\n' "$(( $(date +%s) - START ))" "$*"; }
die() { printf 'demo: %s\n' "$*" >&2; exit 1; }

step "1/9 build what is missing (cold: about an hour on 2 cores; warm: seconds)"
"$CLUSTER" build
HELM=$("$REPO/hack/install-helm.sh" | tail -n 1)
"$REPO/hack/build-kubelet-kep5322.sh" >/dev/null # the KEP-5322 prototype kubelet

step "2/9 start the local cluster with its node"
"$CLUSTER" up --with-node
eval "$("$CLUSTER" env)"
k() { kubectl "$@"; }
NODE=$(k get nodes -o jsonpath='{.items[0].metadata.name}')
say "node $NODE: $(k get node "$NODE" -o jsonpath='{.status.nodeInfo.kubeletVersion} {.status.nodeInfo.containerRuntimeVersion}')"

# The image `up` built from this tree and imported as gpu-dra-driver:src-<source hash>.
IMAGE_TAG=$("$CLUSTER" driver-image-tag)
device_names() { k get resourceslices --field-selector spec.driver=gpu.example.com -o jsonpath='{range .items[*]}{range .spec.devices[*]}{.name}{"\n"}{end}{end}'; }
# "<devices> <reference partitions>" published: 472 0 with the demo values (22 GPUs and
# their MIG partitions), 110 88 with demo/partitions/values.yaml (4 + full per GPU).
layout() { { device_names || true; } | awk '/./ {n++} /-partition-/ {p++} END {print n + 0, p + 0}'; }
# install_driver <expected layout> [extra values file]: helm upgrade --install, wait for
# the plugin pod of this image and for exactly that layout (an upgrade's old slices stay
# until the new plugin registers and replaces them).
install_driver() {
  local want=$1 got=
  "$HELM" upgrade --install "$RELEASE" "$CHART" --namespace "$DRIVER_NS" --create-namespace \
    -f "$CHART/values-mock.yaml" -f "$DEMO_DIR/values-demo.yaml" ${2:+-f "$2"} \
    --set-string image.tag="$IMAGE_TAG" --wait --timeout 5m
  k -n "$DRIVER_NS" rollout status daemonset --timeout=180s
  # The newest one: after an upgrade the old pod may still be terminating (and Running).
  PLUGIN_POD=$(k -n "$DRIVER_NS" get pods -l app.kubernetes.io/component=kubeletplugin --field-selector status.phase=Running \
    --sort-by=.metadata.creationTimestamp -o jsonpath='{range .items[*]}{.metadata.name} {.spec.containers[0].image}{"\n"}{end}' |
    awk -v tag=":$IMAGE_TAG" 'index($2, tag) {pod = $1} END {print pod}')
  [[ -n $PLUGIN_POD ]] || die "no running plugin pod with image tag $IMAGE_TAG"
  say "plugin pod $PLUGIN_POD registered with the kubelet; waiting for its ResourceSlices"
  for _ in $(seq 180); do got=$(layout); [[ $got == "$want" ]] && break; sleep 1; done
  [[ $got == "$want" ]] || die "published devices and reference partitions: $got, expected $want"
  say "$(k get resourceslices --field-selector spec.driver=gpu.example.com --no-headers | wc -l) ResourceSlices, ${got% *} devices"
}
# show_gpus <file>: per pod and container (init containers first) the GPUs it saw.
show_gpus() {
  local f=$1 ns pod c gpus extra
  ns=$(awk '/^kind: Namespace/{f=1} f && /name:/{print $2; exit}' "$f")
  printf '\n# %s (namespace %s)\n' "${f#"$DEMO_DIR"/}" "$ns"
  for pod in $(k -n "$ns" get pods -l app=gpu-demo -o jsonpath='{.items[*].metadata.name}'); do
    for c in $(k -n "$ns" get pod "$pod" -o jsonpath='{.spec.initContainers[*].name} {.spec.containers[*].name}'); do
      gpus=$(k -n "$ns" logs "$pod" -c "$c" | sed -n 's/^GPU_DEVICE_[A-Z0-9_]*=\(gpu-.*\)$/\1/p' | sort -V | tr '\n' ' ')
      extra=$(k -n "$ns" logs "$pod" -c "$c" | grep -E '_(SHARING_STRATEGY|TIMESLICE_INTERVAL|PARTITION_COUNT|MEMORY|COMPUTE)=|^DRA_ADMIN_ACCESS=true|^CUDA_MPS_(ACTIVE_THREAD_PERCENTAGE|PINNED_DEVICE_MEM_LIMIT)=' | sed 's/^GPU_DEVICE_//' | sort -u | tr '\n' ' ')
      printf '  %-8s %-8s GPUs: %s\n' "$pod" "$c" "${gpus:-none}"
      [[ -n $extra ]] && printf '  %-17s %s\n' "" "$extra"
    done
  done
}
wait_ready() { # <namespace|-A> <what>
  local scope=(-n "$1") n=
  [[ $1 == -A ]] && scope=(-A)
  not_ready() { k get pods "${scope[@]}" -l app=gpu-demo -o jsonpath='{range .items[*]}{.metadata.namespace}/{.metadata.name} {.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' | awk '$2 != "True"' | wc -l; }
  for _ in $(seq 300); do n=$(not_ready); (( n == 0 )) && break; sleep 1; done
  (( n == 0 )) ||
    { k get pods "${scope[@]}" -l app=gpu-demo -o wide; k get events "${scope[@]}" --field-selector type=Warning | tail -20; die "$2 not Ready"; }
  k get pods "${scope[@]}" -l app=gpu-demo -o wide
}

step "3/9 helm install the driver gpu-dra-driver:$IMAGE_TAG (mock GPUs, values-mock.yaml + demo/values-demo.yaml)"
install_driver "472 0"

# Reference partitions replace the MIG devices node-wide, so this example runs alone,
# before the others (nothing may hold a MIG device or a whole GPU while the layout
# changes) and the driver goes back to the demo values afterwards.
PARTITION_EXAMPLE=$DEMO_DIR/partitions/shared-partition-capacity.yaml
step "4/9 sharing a partition by capacity (helm upgrade -f demo/partitions/values.yaml: kubeletPlugin.gpuPartitions=4)"
if [[ -n $(k get resourceclaims -A -o name) ]]; then
  say "skipped: ResourceClaims of an earlier run hold devices of the MIG layout (GPU_DRA_DEMO_CLEAN=1 removes the examples at the end of a run)"
else
  install_driver "110 88" "$DEMO_DIR/partitions/values.yaml"
  k apply -f "$PARTITION_EXAMPLE" >/dev/null
  wait_ready gpu-demo-partition-capacity "partition example pods"
  show_gpus "$PARTITION_EXAMPLE"
  say "two pods share one partition (MEMORY=8Gi, COMPUTE=10 each); the third, which would exceed it, got another"
  k delete -f "$PARTITION_EXAMPLE" --wait=true --timeout=240s >/dev/null
  say "back to the demo values (MIG partitions)"
  install_driver "472 0"
fi

MPS_EXAMPLE=$DEMO_DIR/mps/cooperative-shares.yaml
step "5/9 shares limited per process through MPS, cooperative (helm upgrade -f demo/mps/values.yaml: kubeletPlugin.mps.enabled=true)"
if [[ -n $(k get resourceclaims -A -o name) ]]; then
  say "skipped: ResourceClaims of an earlier run hold devices (GPU_DRA_DEMO_CLEAN=1 removes the examples at the end of a run)"
else
  install_driver "472 0" "$DEMO_DIR/mps/values.yaml"
  k apply -f "$MPS_EXAMPLE" >/dev/null
  wait_ready gpu-demo-mps "MPS example pods"
  show_gpus "$MPS_EXAMPLE"
  say "each share's MPS daemon (a Deployment in $DRIVER_NS), with the limits it holds (read back through its control pipe):"
  for d in $(k -n "$DRIVER_NS" get deployments -l gpu.example.com/mps-daemon -o jsonpath='{.items[*].metadata.name}'); do
    printf '  %s on GPU %s: %s\n' "$d" "$(k -n "$DRIVER_NS" get deployment "$d" -o jsonpath='{.metadata.annotations.gpu\.example\.com/gpu}')" \
      "$(k -n "$DRIVER_NS" logs "deployment/$d" | sed -n 's/.*MPS control daemon [0-9]* for GPU [^ ]* \(holds .*\)$/\1/p' | tail -n 1)"
  done
  say "the limits bind each CUDA process of a share, not the share as a whole; a process that points CUDA_MPS_PIPE_DIRECTORY elsewhere is not limited (mpsIsolation: cooperative, docs/mps.md)"
  k delete -f "$MPS_EXAMPLE" --wait=true --timeout=240s >/dev/null
  left=$(k -n "$DRIVER_NS" get deployments -l gpu.example.com/mps-daemon -o name | wc -l)
  say "the pods deleted: their claims unprepared, $left MPS daemon Deployment(s) left; back to the demo values"
  install_driver "472 0"
fi

STRICT_EXAMPLE=$DEMO_DIR/mps/strict-partitions.yaml
step "6/9 the partitions of one GPU under one MPS server, strict (helm upgrade -f demo/mps/values-strict-partitions.yaml: kubeletPlugin.mps.strictPartitions=true)"
if [[ -n $(k get resourceclaims -A -o name) ]]; then
  say "skipped: ResourceClaims of an earlier run hold devices (GPU_DRA_DEMO_CLEAN=1 removes the examples at the end of a run)"
else
  install_driver "66 44" "$DEMO_DIR/mps/values-strict-partitions.yaml"
  k apply -f "$STRICT_EXAMPLE" >/dev/null
  wait_ready gpu-demo-mps-strict "strict partition pods"
  show_gpus "$STRICT_EXAMPLE"
  say "the GPUs' MPS daemons (Deployments in $DRIVER_NS): one per GPU, multi-user, with the partition's limits:"
  for d in $(k -n "$DRIVER_NS" get deployments -l gpu.example.com/mps-daemon -o jsonpath='{.items[*].metadata.name}'); do
    printf '  %s on GPU %s (%s): %s\n' "$d" "$(k -n "$DRIVER_NS" get deployment "$d" -o jsonpath='{.metadata.annotations.gpu\.example\.com/gpu}')" \
      "$(k -n "$DRIVER_NS" get deployment "$d" -o jsonpath='{.spec.template.spec.containers[0].command}' | grep -o -- '--multi-user' || echo 'one user')" \
      "$(k -n "$DRIVER_NS" logs "deployment/$d" | sed -n 's/.*MPS control daemon [0-9]* for GPU [^ ]* \(holds .*\)$/\1/p' | tail -n 1)"
  done
  mock_process() { k -n "$DRIVER_NS" exec "$PLUGIN_POD" -c plugin -- gpu-dra mock process "$@" 2>&1 | grep -v '^command terminated' || true; }
  dev=$(k -n gpu-demo-mps-strict logs pod0 -c ctr0 | sed -n 's/^GPU_DEVICE_[A-Z0-9_]*=\(gpu-.*\)$/\1/p' | head -n 1)
  client=$(mock_process --device "$dev" --kind mps-client)
  say "an MPS client of pod0's claim (the mock's): $client"
  say "a process outside MPS on that GPU, in EXCLUSIVE_PROCESS: $(mock_process --device "$dev" --kind compute)"
  pid=$(sed -n 's/.*process \([0-9]*\) on.*/\1/p' <<<"$client")
  [[ -n $pid ]] && mock_process --end "$pid" >/dev/null
  k delete -f "$STRICT_EXAMPLE" --wait=true --timeout=240s >/dev/null
  left=$(k -n "$DRIVER_NS" get deployments -l gpu.example.com/mps-daemon -o name | wc -l)
  say "the pods deleted: the last claim's unprepare stopped the daemon and put the compute mode back, $left MPS daemon Deployment(s) left; back to the demo values"
  install_driver "472 0"
fi

step "7/9 apply the examples"
# Cluster-scoped objects of the examples outlive their namespaces: delete them however
# the demo ends (at the end, or on a failure through the trap; the examples' pods keep
# running, NoSchedule evicts nothing).
delete_cluster_scoped() {
  k delete devicetaintrules -l app=gpu-demo --ignore-not-found >/dev/null 2>&1 &&
    say "deleted the demo's DeviceTaintRules (kubectl delete devicetaintrules -l app=gpu-demo)"
}
trap delete_cluster_scoped EXIT
for f in "$DEMO_DIR"/[0-9]*.yaml; do
  say "kubectl apply -f demo/$(basename "$f")"
  k apply -f "$f" >/dev/null
done
say "waiting for every example pod to be Ready"
wait_ready -A "example pods"

step "8/9 the GPUs each container sees (kubectl logs: env | grep GPU_DEVICE)"
for f in "$DEMO_DIR"/[0-9]*.yaml; do show_gpus "$f"; done
say "prioritized alternatives: $(k -n gpu-demo-prioritized get resourceclaims -o jsonpath='{range .items[*]}{.metadata.name}={.status.allocation.devices.results[0].request} {end}')"
say "extended resources: $(k -n gpu-demo-extended-resources get pods -o jsonpath='{range .items[*]}{.metadata.name}: claim {.status.extendedResourceClaimStatus.resourceClaimName} for {.status.extendedResourceClaimStatus.requestMappings[0].resourceName}; {end}')"

step "9/9 failure scenarios"
say "permanent error: a claim asks for 64 partitions (demo/scenarios/permanent-error.yaml)"
k apply -f "$DEMO_DIR/scenarios/permanent-error.yaml" >/dev/null
msg=
for _ in $(seq 120); do
  msg=$(k -n gpu-demo-permanent-error get events --field-selector reason=FailedPrepareDynamicResources -o jsonpath='{.items[0].message}' 2>/dev/null || true)
  [[ -n $msg ]] && break
  sleep 1
done
[[ $msg == *"permanent (invalid-config)"* ]] || die "no FailedPrepareDynamicResources event with 'permanent (invalid-config)' (got: ${msg:-nothing})"
say "pod0 event FailedPrepareDynamicResources: $msg"
PLUGIN_IP=$(k -n "$DRIVER_NS" get pod "$PLUGIN_POD" -o jsonpath='{.status.podIP}')
# Summed over the error_class label: gpu_dra_permanent_verdict_replays_total{error_class="..."} N
replays() { curl -sf "http://$PLUGIN_IP:8080/metrics" | awk '/^gpu_dra_permanent_verdict_replays_total[{ ]/{n += $NF; seen = 1} END {if (seen) print n}'; }
say "waiting for the kubelet to retry (its backoff grows; the plugin answers from its remembered verdict)"
r=
for _ in $(seq 90); do
  r=$(replays || true); [[ -n $r && ${r%.*} -ge 1 ]] && break; sleep 2
done
[[ -n $r && ${r%.*} -ge 1 ]] || die "gpu_dra_permanent_verdict_replays_total stayed at ${r:-absent} in the plugin's /metrics"
say "plugin metrics: $(curl -sf "http://$PLUGIN_IP:8080/metrics" | grep -E '^gpu_dra_(permanent_verdict_replays|prepare_claims)_total' | tr '\n' ' ')"
k -n gpu-demo-permanent-error get pod pod0 -o wide
# The kubelet's calls for a claim: one `NodePrepareResources: <ns>/<claim>` line each in
# the plugin's log.
prepare_calls() { # <namespace> <claim>
  k -n "$DRIVER_NS" logs "$PLUGIN_POD" -c plugin | grep -c "NodePrepareResources: .*$1/$2\b" || true
}
claim_of() { k -n "$1" get pod pod0 -o jsonpath='{.status.resourceClaimStatuses[0].resourceClaimName}'; }
today_claim=$(claim_of gpu-demo-permanent-error)
today="pod0 $(k -n gpu-demo-permanent-error get pod pod0 -o jsonpath='{.status.phase}') after $(( $(date +%s) - $(date -d "$(k -n gpu-demo-permanent-error get pod pod0 -o jsonpath='{.metadata.creationTimestamp}')" +%s) ))s, $(prepare_calls gpu-demo-permanent-error "$today_claim") NodePrepareResources for $today_claim"
k delete namespace gpu-demo-permanent-error --wait=false >/dev/null

say "the same claim on the KEP-5322 prototype kubelet (DRAHandlePermanentDriverFailures=true): restarting the node's kubelet as the prototype"
GPU_DRA_KEP5322_KUBELET=1 "$CLUSTER" restart-kubelet | tail -n 1
registered() { curl -sf "http://$PLUGIN_IP:8080/metrics" | awk '/^gpu_dra_kubelet_registered /{print $NF}'; }
for _ in $(seq 60); do [[ $(registered || true) == 1.0 ]] && break; sleep 1; done
sed 's/gpu-demo-permanent-error/gpu-demo-kep5322/' "$DEMO_DIR/scenarios/permanent-error.yaml" | k apply -f - >/dev/null
phase=
for _ in $(seq 150); do
  phase=$(k -n gpu-demo-kep5322 get pod pod0 -o jsonpath='{.status.phase}' 2>/dev/null || true)
  [[ $phase == Failed ]] && break; sleep 1
done
[[ $phase == Failed ]] || die "pod0 did not fail on the prototype kubelet (phase: ${phase:-none})"
proto_claim=$(claim_of gpu-demo-kep5322)
proto="pod0 Failed after $(( $(date +%s) - $(date -d "$(k -n gpu-demo-kep5322 get pod pod0 -o jsonpath='{.metadata.creationTimestamp}')" +%s) ))s, $(prepare_calls gpu-demo-kep5322 "$proto_claim") NodePrepareResources for $proto_claim"
say "pod0 $(k -n gpu-demo-kep5322 get pod pod0 -o jsonpath='{.status.reason}: {.status.message}')"
k -n gpu-demo-kep5322 get pod pod0 -o wide
say "today's kubelet:        $today (retrying, answered from the remembered verdict)"
say "KEP-5322 prototype:     $proto (no retry; claim unprepared)"
k delete namespace gpu-demo-kep5322 --wait=false >/dev/null
say "back to today's kubelet"
GPU_DRA_KEP5322_KUBELET=0 "$CLUSTER" restart-kubelet | tail -n 1
for _ in $(seq 60); do [[ $(registered || true) == 1.0 ]] && break; sleep 1; done

say "Xid 79 on the GPU of a running Deployment pod (demo/scenarios/xid-eviction.yaml; xidTaintEffect NoExecute)"
k apply -f "$DEMO_DIR/scenarios/xid-eviction.yaml" >/dev/null
k -n gpu-demo-xid rollout status deployment/trainer --timeout=180s >/dev/null
old_pod=$(k -n gpu-demo-xid get pods -l app=gpu-demo-xid -o jsonpath='{.items[0].metadata.name}')
gpu=$(k -n gpu-demo-xid logs "$old_pod" | sed -n 's/^GPU_DEVICE_[A-Z0-9_]*=\(gpu-[0-9]*\)$/\1/p' | head -n 1)
[[ -n $gpu ]] || die "pod $old_pod printed no GPU"
say "pod $old_pod runs on $gpu; injecting: kubectl exec $PLUGIN_POD -- gpu-dra mock xid --device $gpu --xid 79"
k -n "$DRIVER_NS" exec "$PLUGIN_POD" -c plugin -- gpu-dra mock xid --device "$gpu" --xid 79
# ResourceHealthStatus: the kubelet reports the plugin's health stream in the status of
# the containers using the device; the evicted pod shows it until it is gone. Printed:
# the entries naming the GPU (the kubelet names a device by its first CDI id,
# `k8s.gpu.example.com/gpu=<claim uid>-<device>`), else every entry.
pod_health() { # <namespace> <pod> <gpu>
  local json
  json=$(k -n "$1" get pod "$2" -o json 2>/dev/null) || return 0
  python3 -c '
import json, sys
gpu = sys.argv[1]
named, other = [], []
for c in json.load(sys.stdin)["status"].get("containerStatuses", []):
    for r in c.get("allocatedResourcesStatus") or []:
        for h in r.get("resources") or []:
            rid = h.get("resourceID", "")
            line = "%s: %s %s health=%s" % (c["name"], r["name"], rid, h.get("health"))
            (named if rid.endswith("-" + gpu) else other).append(line)
print("; ".join(named or other))
' "$3" <<<"$json" 2>/dev/null || true
}
health=
h=
for _ in $(seq 120); do
  h=$(pod_health gpu-demo-xid "$old_pod" "$gpu"); [[ -n $h ]] && health=$h  # the last one reported
  taint=$(k get resourceslices --field-selector spec.driver=gpu.example.com -o json |
    python3 -c 'import json,sys; d=sys.argv[1]; print(" ".join("%s=%s:%s" % (t["key"], t.get("value", ""), t["effect"]) for s in json.load(sys.stdin)["items"] for x in s["spec"].get("devices",[]) if x["name"]==d for t in x.get("taints",[])))' "$gpu")
  [[ -n $taint ]] && break; sleep 1
done
say "ResourceSlice: $gpu taints: ${taint:-none}"
say "waiting for the eviction of $old_pod and a replacement on a healthy GPU"
new_pod=
for _ in $(seq 180); do
  h=$(pod_health gpu-demo-xid "$old_pod" "$gpu"); [[ -n $h ]] && health=$h  # the last one reported
  new_pod=$(k -n gpu-demo-xid get pods -l app=gpu-demo-xid --field-selector status.phase=Running -o jsonpath='{range .items[*]}{.metadata.name} {.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' | awk -v old="$old_pod" '$1 != old && $2 == "True" {print $1; exit}')
  [[ -n $new_pod ]] && break; sleep 1
done
[[ -n $new_pod ]] || { k -n gpu-demo-xid get pods,events; die "no replacement pod became Ready"; }
new_gpu=$(k -n gpu-demo-xid logs "$new_pod" | sed -n 's/^GPU_DEVICE_[A-Z0-9_]*=\(gpu-[0-9]*\)$/\1/p' | head -n 1)
say "$old_pod evicted: $(k -n gpu-demo-xid get events --field-selector involvedObject.name="$old_pod" -o jsonpath='{range .items[*]}{.reason}: {.message}{"\n"}{end}' | grep -iE 'evict|taint|kill' | head -n 2 | tr '\n' ' ')"
say "replacement $new_pod runs on $new_gpu (was $gpu)"
[[ $new_gpu != "$gpu" ]] || die "replacement got the failed GPU $gpu"
k -n gpu-demo-xid get pods -o wide
say "device health in pod status (allocatedResourcesStatus of $old_pod while it was evicted): ${health:-not reported by this cluster before the pod was gone}"
say "clearing the mock Xid: gpu-dra mock reset --all"
k -n "$DRIVER_NS" exec "$PLUGIN_POD" -c plugin -- gpu-dra mock reset --all

if [[ ${GPU_DRA_DEMO_CLEAN:-0} == 1 ]]; then
  k delete namespace gpu-demo-xid >/dev/null
  for f in "$DEMO_DIR"/[0-9]*.yaml; do k delete -f "$f" --wait=false --ignore-not-found >/dev/null; done
fi
trap - EXIT
delete_cluster_scoped
step "done in $(( $(date +%s) - START ))s"
cat <<EOF
The cluster keeps running:
  eval "\$($CLUSTER env)"; kubectl get pods -A
  $CLUSTER down          # stop everything
EOF
