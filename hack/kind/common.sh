# shellcheck shell=bash
# Settings shared by the hack/kind scripts. Sourced, not executed.
# shellcheck disable=SC2034  # the settings are used by the scripts that source this one
#
# One source of truth with the project's own (Docker-free) local cluster:
#   - feature gates (FEATURE_GATES), runtime config (RUNTIME_CONFIG) and the Kubernetes
#     version come from hack/lib/common.sh / hack/versions.env, which hack/local-cluster.sh
#     uses too,
#   - the chart values from deployments/helm/gpu-dra-driver/values-mock.yaml, which the
#     integration tests (tests/integration/test_chart.py) install too.

KIND_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
HACK_DIR=$(cd "$KIND_DIR/.." && pwd)
REPO_DIR=$(cd "$HACK_DIR/.." && pwd)
# shellcheck source=hack/lib/common.sh
source "$HACK_DIR/lib/common.sh"

CHART_DIR=$REPO_DIR/deployments/helm/gpu-dra-driver
MOCK_VALUES=$CHART_DIR/values-mock.yaml

KIND_CLUSTER_NAME=${KIND_CLUSTER_NAME:-gpu-dra-driver}
KIND_K8S_TAG=${KIND_K8S_TAG:-v$K8S_VERSION}
KIND_IMAGE=${KIND_IMAGE:-kindest/node:$KIND_K8S_TAG}
KIND_WORKERS=${KIND_WORKERS:-1}
# values-mock.yaml's image (gpu-dra-driver:dev) as the kubelet (CRI) normalizes it, so
# that a plain `helm install -f values-mock.yaml` finds the image loaded here. Fully
# qualified: Podman would store an unqualified build as localhost/<name>, which the
# kubelet never looks for (ErrImagePull). install.sh passes repository and tag to helm
# (image.repository / image.tag) all the same.
DRIVER_IMAGE=${DRIVER_IMAGE:-docker.io/library/gpu-dra-driver:dev}
# The DRA driver name the chart registers (ResourceSlice spec.driver, DeviceClasses).
DRIVER_NAME=${DRIVER_NAME:-gpu.example.com}
DRIVER_NAMESPACE=${DRIVER_NAMESPACE:-gpu-dra-driver}
HELM_RELEASE=${HELM_RELEASE:-gpu-dra-driver}
KUBE_CONTEXT=kind-$KIND_CLUSTER_NAME

if [[ -z ${CONTAINER_TOOL:-} ]]; then
  if command -v docker >/dev/null; then CONTAINER_TOOL=docker
  elif command -v podman >/dev/null; then CONTAINER_TOOL=podman
  else CONTAINER_TOOL=docker
  fi
fi
export KIND_EXPERIMENTAL_PROVIDER=$CONTAINER_TOOL

kind_progress() { printf '[kind %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
kind_die() { printf '%s: %s\n' "$(basename "$0")" "$*" >&2; exit 1; }
need() {
  local tool
  for tool in "$@"; do
    command -v "$tool" >/dev/null || kind_die "$tool is required (see hack/kind/README.md)"
  done
}

# The pinned helm from hack/install-helm.sh, else one on PATH.
find_helm() {
  local pinned
  pinned=$("$HACK_DIR/install-helm.sh" path)
  if [[ -x $pinned ]]; then printf '%s\n' "$pinned"
  elif command -v helm >/dev/null; then command -v helm
  else kind_die "helm not found: run hack/install-helm.sh"
  fi
}
