#!/usr/bin/env bash
# Runs demo workloads against the driver installed by install.sh (mock GPUs) and
# prints what each container received:
#   - pod gpu-pod:        one whole GPU (DeviceClass <driver>)
#   - pod mig-pod:        one GPU partition (DeviceClass mig.<driver>)
#   - pods shared-0/1:    one claim with a GpuConfig (SpacePartitioning, 2 partitions:
#                         advisory) shared by two pods. values-mock.yaml's GPUs are in
#                         MIG mode, where no time-slice interval can be set (refused).
#
#   hack/kind/demo.sh             apply, wait, print env and allocations
#   hack/kind/demo.sh --cleanup   delete the demo namespace
set -euo pipefail
# shellcheck source=hack/kind/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

DEMO_NAMESPACE=${DEMO_NAMESPACE:-gpu-dra-demo}
DEMO_IMAGE=${DEMO_IMAGE:-busybox:1.36}
KUBECTL=(kubectl --context "$KUBE_CONTEXT")

need kubectl
if [[ ${1:-} == --cleanup ]]; then
  "${KUBECTL[@]}" delete namespace "$DEMO_NAMESPACE" --ignore-not-found --wait
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
      command: ["sh", "-c", "env | grep -E '^(GPU_DEVICE|NVIDIA|DRA)' | sort; trap 'exit 0' TERM; sleep 9999 & wait"]
      resources:
        claims:
          - name: gpu
  resourceClaims:
    - name: gpu
      $2
YAML
}

kind_progress "applying the demo in namespace $DEMO_NAMESPACE"
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
kind_progress "shared-0 and shared-1 show the same GPU with PARTITION_COUNT=2; clean up with: $0 --cleanup"
