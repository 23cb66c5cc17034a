#!/usr/bin/env bash
# Installs (or upgrades) the chart into the kind cluster with the mock NVML backend:
# deployments/helm/gpu-dra-driver/values-mock.yaml - the same values file the
# integration tests use. Extra arguments go to helm, e.g. --set webhook.enabled=false.
set -euo pipefail
# shellcheck source=hack/kind/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

need kubectl
HELM=$(find_helm)
repo=${DRIVER_IMAGE%:*}
tag=${DRIVER_IMAGE##*:}

# The plugin pods need the privileged Pod Security level (host paths, root).
kubectl --context "$KUBE_CONTEXT" create namespace "$DRIVER_NAMESPACE" --dry-run=client -o yaml |
  kubectl --context "$KUBE_CONTEXT" apply -f - >/dev/null
kubectl --context "$KUBE_CONTEXT" label namespace "$DRIVER_NAMESPACE" --overwrite \
  pod-security.kubernetes.io/enforce=privileged >/dev/null

kind_progress "installing release $HELM_RELEASE ($CHART_DIR, values-mock.yaml, image $repo:$tag) in namespace $DRIVER_NAMESPACE"
"$HELM" upgrade --install "$HELM_RELEASE" "$CHART_DIR" \
  --kube-context "$KUBE_CONTEXT" \
  --namespace "$DRIVER_NAMESPACE" --create-namespace \
  --values "$MOCK_VALUES" \
  --set-string image.repository="$repo" --set-string image.tag="$tag" \
  --wait --timeout 5m "$@"

kind_progress "waiting for ResourceSlices of driver $DRIVER_NAME"
for _ in $(seq 60); do
  # Only this driver's slices count (another DRA driver's slices would pass a bare check).
  if kubectl --context "$KUBE_CONTEXT" get resourceslices \
       -o jsonpath='{range .items[*]}{.spec.driver}{"\n"}{end}' 2>/dev/null | grep -qxF "$DRIVER_NAME"; then
    kubectl --context "$KUBE_CONTEXT" get resourceslices
    kind_progress "installed; next: hack/kind/demo.sh"
    exit 0
  fi
  sleep 2
done
kubectl --context "$KUBE_CONTEXT" -n "$DRIVER_NAMESPACE" get pods -o wide >&2
kind_die "no ResourceSlices of $DRIVER_NAME after 120 s; see: kubectl -n $DRIVER_NAMESPACE logs -l app.kubernetes.io/component=kubeletplugin"
