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
# The stock node image (KIND_NODE_SOURCE=registry).
KIND_IMAGE=${KIND_IMAGE:-kindest/node:$KIND_K8S_TAG}
# The node image built here without a registry (hack/kind/build-node-image.sh), and the
# repository its control-plane, etcd, kube-proxy images are named under (kubeadm's
# imageRepository; they exist only inside the nodes' containerd).
KIND_OFFLINE_IMAGE=${KIND_OFFLINE_IMAGE:-localhost/gpu-dra/kind-node:$KIND_K8S_TAG}
KIND_COMPONENT_REPO=localhost/gpu-dra/k8s
# `make kind-up` asks for two (one plugin pod and one pool each; the demo shows the
# ValidatingAdmissionPolicy's node scoping with them).
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

# The engine: Docker where its daemon answers (a docker client alone is not enough),
# else Podman (hack/kind/tools.sh installs Debian's). CONTAINER_TOOL overrides.
if [[ -z ${CONTAINER_TOOL:-} ]]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then CONTAINER_TOOL=docker
  else CONTAINER_TOOL=podman
  fi
fi
[[ $CONTAINER_TOOL == docker || $CONTAINER_TOOL == podman ]] ||
  { printf 'CONTAINER_TOOL must be docker or podman, not %s\n' "$CONTAINER_TOOL" >&2; exit 1; }
export CONTAINER_TOOL KIND_EXPERIMENTAL_PROVIDER=$CONTAINER_TOOL
# The container network of this project's clusters (kind's default is "kind", shared
# with any other kind cluster); delete-cluster.sh removes it once no node uses it.
KIND_NETWORK=${KIND_NETWORK:-gpu-dra-kind}
export KIND_EXPERIMENTAL_PODMAN_NETWORK=$KIND_NETWORK KIND_EXPERIMENTAL_DOCKER_NETWORK=$KIND_NETWORK
# Podman's settings for this host (hack/kind/tools.sh writes them); the host's own
# containers.conf stays untouched.
PODMAN_CONF=$CACHE_ROOT/kind/containers.conf
if [[ $CONTAINER_TOOL == podman && -f $PODMAN_CONF ]]; then export CONTAINERS_CONF=$PODMAN_CONF; fi
# kind at KIND_VERSION (hack/versions.env), built by hack/kind/tools.sh; else one on PATH.
KIND=${KIND:-$CACHE_ROOT/bin/kind-v$KIND_VERSION/kind}
[[ -x $KIND ]] || KIND=$(command -v kind || printf 'kind')
# kubectl at K8S_VERSION from the project's build, else one on PATH.
KUBECTL=${KUBECTL:-$BIN_DIR/kubectl}
[[ -x $KUBECTL ]] || KUBECTL=$(command -v kubectl || printf 'kubectl')

# `cmd | has_line LINE`: true when cmd printed LINE. Reads all of cmd's output first: with
# pipefail, `cmd | grep -q` fails when grep exits early and cmd dies of SIGPIPE.
has_line() {
  local text
  text=$(cat)
  grep -qxF -- "$1" <<<"$text"
}
kind_progress() { printf '[kind %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
kind_die() { printf '%s: %s\n' "$(basename "$0")" "$*" >&2; exit 1; }
need() {
  local tool
  for tool in "$@"; do
    command -v "$tool" >/dev/null || kind_die "$tool is required (see hack/kind/README.md)"
  done
}

# The pinned helm (HELM_VERSION): built by hack/install-helm.sh when missing and a Go
# toolchain is there, else a helm on PATH.
find_helm() {
  local pinned log
  pinned=$("$HACK_DIR/install-helm.sh" path)
  # Another hack/install-helm.sh is building it (its .partial directory, its log still
  # growing): a second one would delete that directory under it. Wait for it instead.
  log=$(dirname "$(dirname "$pinned")")/build-helm-v$HELM_VERSION.log
  while [[ ! -x $pinned && -d $(dirname "$pinned")/.partial && -f $log ]] &&
        (( $(date +%s) - $(stat -c %Y "$log") < 300 )); do
    kind_progress "helm v$HELM_VERSION is being built by another hack/install-helm.sh; waiting: $(tail -n 1 "$log")" >&2
    sleep 15
  done
  if [[ -x $pinned ]]; then printf '%s\n' "$pinned"
  elif command -v go >/dev/null; then "$HACK_DIR/install-helm.sh" >&2 && printf '%s\n' "$pinned"
  elif command -v helm >/dev/null; then command -v helm
  else kind_die "no helm: hack/install-helm.sh builds the pinned one (needs go)"
  fi
}
