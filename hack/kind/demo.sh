#!/usr/bin/env bash
# Runs demo workloads against the driver installed by install.sh (mock GPUs) and
# prints what each container received:
#   1. pod gpu-pod:        one whole GPU (DeviceClass <driver>)
#      pod mig-pod:        one GPU partition (DeviceClass mig.<driver>)
#      pods shared-0/1:    one claim with a GpuConfig (SpacePartitioning, 2 partitions:
#                          advisory) shared by two pods. values-mock.yaml's GPUs are in
#                          MIG mode, where no time-slice interval can be set (refused).
#   2. the node-scoped ValidatingAdmissionPolicy refusing one worker's plugin a slice of
#      the other worker (hack/kind/vap-check.sh; with two workers or more)
#   3. the admission webhook refusing a claim with an invalid GpuConfig (dry run)
#   4. a permanent error (demo/scenarios/permanent-error.yaml): its Event on the pod
#   5. an Xid on the GPU of a Deployment's pod (demo/scenarios/xid-eviction.yaml): the
#      device is tainted NoExecute, the pod evicted and replaced on a healthy GPU
# Exits non-zero when any of these does not happen. The scenario namespaces are deleted
# and the mock Xid cleared at the end; the pods of step 1 keep running.
#
#   hack/kind/demo.sh             run it
#   hack/kind/demo.sh --cleanup   delete the demo namespace
set -euo pipefail
# shellcheck source=hack/kind/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

DEMO_NAMESPACE=${DEMO_NAMESPACE:-gpu-dra-demo}
# Loaded into the nodes by build-and-load-image.sh; never pulled.
DEMO_IMAGE=${DEMO_IMAGE:-localhost/gpu-dra/busybox:1.35}
SCENARIOS=$REPO_DIR/demo/scenarios
KUBECTL=("$KUBECTL" --context "$KUBE_CONTEXT")
k() { "${KUBECTL[@]}" "$@"; }

if [[ ${1:-} == --cleanup ]]; then
  [[ $# -eq 1 ]] || kind_die "usage: $0 [--cleanup]"
  k delete namespace "$DEMO_NAMESPACE" gpu-demo-permanent-error gpu-demo-xid --ignore-not-found --wait
  exit 0
fi
[[ $# -eq 0 ]] || kind_die "usage: $0 [--cleanup]"

pod() {  # name, claim-source line
  cat <<YAML
---
apiVersion: v1
kind: Pod
metadata:
  name: $1
  namespace: $DEMO_NAMESPACE
spec:
  terminationGracePeriodSeconds: 5
  containers:
    - name: ctr
      image: $DEMO_IMAGE
      imagePullPolicy: IfNotPresent
      command: ["sh", "-c", "env | grep -E '^(GPU_DEVICE|NVIDIA|DRA)' | sort; trap 'exit 0' TERM; sleep 9999 & wait"]
      resources:
        claims:
          - name: gpu
  resourceClaims:
    - name: gpu
      $2
YAML
}

kind_progress "1. applying the demo in namespace $DEMO_NAMESPACE"
{
  cat <<YAML
apiVersion: v1
kind: Namespace
metadata:
  name: $DEMO_NAMESPACE
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: whole-gpu
  namespace: $DEMO_NAMESPACE
spec:
  spec:
    devices:
      requests:
        - name: gpu
          exactly:
            deviceClassName: $DRIVER_NAME
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: gpu-partition
  namespace: $DEMO_NAMESPACE
spec:
  spec:
    devices:
      requests:
        - name: gpu
          exactly:
            deviceClassName: mig.$DRIVER_NAME
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata:
  name: shared-gpu
  namespace: $DEMO_NAMESPACE
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: $DRIVER_NAME
    config:
      - requests: ["gpu"]
        opaque:
          driver: $DRIVER_NAME
          parameters:
            apiVersion: gpu.resource.example.com/v1alpha1
            kind: GpuConfig
            sharing:
              strategy: SpacePartitioning
              spacePartitioningConfig:
                partitionCount: 2
YAML
  pod gpu-pod "resourceClaimTemplateName: whole-gpu"
  pod mig-pod "resourceClaimTemplateName: gpu-partition"
  pod shared-0 "resourceClaimName: shared-gpu"
  pod shared-1 "resourceClaimName: shared-gpu"
} | "${KUBECTL[@]}" apply -f -

kind_progress "waiting for the pods to run"
"${KUBECTL[@]}" -n "$DEMO_NAMESPACE" wait --for=condition=Ready pod --all --timeout=180s
"${KUBECTL[@]}" -n "$DEMO_NAMESPACE" get pods -o wide
echo
"${KUBECTL[@]}" -n "$DEMO_NAMESPACE" get resourceclaims \
  -o custom-columns='CLAIM:.metadata.name,DEVICES:.status.allocation.devices.results[*].device,RESERVED-FOR:.status.reservedFor[*].name'
for p in gpu-pod mig-pod shared-0 shared-1; do
  echo
  kind_progress "environment of $p"
  "${KUBECTL[@]}" -n "$DEMO_NAMESPACE" logs "$p"
done
echo
kind_progress "shared-0 and shared-1 show the same GPU with PARTITION_COUNT=2"
"$KIND_DIR/demo-scenarios.sh"
