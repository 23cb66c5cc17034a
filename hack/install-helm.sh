#!/usr/bin/env bash
# Installs the pinned helm (HELM_VERSION in hack/versions.env) into the project cache,
# outside the repository, by building it from the Go module proxy. No prebuilt
# download, no Docker.
#
#   hack/install-helm.sh          build helm unless cached; prints its path last
#   hack/install-helm.sh path     print where the pinned helm lives (built or not)
#
# Cache: ${GPU_DRA_CACHE:-${XDG_CACHE_HOME:-~/.cache}/gpu-dra-driver}/bin/tools/helm-v<version>/helm
# (the same cache root hack/local-cluster.sh uses). A cold build takes a few minutes.
set -euo pipefail

HACK_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=hack/versions.env
source "$HACK_DIR/versions.env"
: "${HELM_VERSION:?HELM_VERSION missing from hack/versions.env}"

CACHE_ROOT=${GPU_DRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-driver}
TOOLS_DIR=$CACHE_ROOT/bin/tools
HELM_DIR=$TOOLS_DIR/helm-v$HELM_VERSION
HELM_BIN=$HELM_DIR/helm
HELM_MAJOR=${HELM_VERSION%%.*}

START_TIME=$(date +%s)
progress() { printf '[install-helm %4ss] %s\n' "$(( $(date +%s) - START_TIME ))" "$*" >&2; }
die() { printf 'install-helm: %s\n' "$*" >&2; exit 1; }
# shellcheck source=hack/lib/go-progress.sh
source "$HACK_DIR/lib/go-progress.sh"

if [[ ${1:-} == path ]]; then
  printf '%s\n' "$HELM_BIN"
  exit 0
fi
[[ $# -eq 0 ]] || die "usage: $0 [path]"

cached() {
  [[ -x $HELM_BIN ]] && "$HELM_BIN" version --template '{{.Version}}' 2>/dev/null | grep -qx "v$HELM_VERSION"
}
if cached; then
  progress "helm v$HELM_VERSION cached"
  printf '%s\n' "$HELM_BIN"
  exit 0
fi

command -v go >/dev/null || die "go is required to build helm (go >= 1.25)"
mkdir -p "$HELM_DIR"
# One build at a time per cache (`make demo` and `make test` side by side, parallel
# make targets): a second one would remove the first one's partial build.
exec 9>"$HELM_DIR/.build.lock"
if ! flock -n 9; then
  progress "another build holds $HELM_DIR/.build.lock; waiting for it"
  flock 9
  if cached; then
    progress "helm v$HELM_VERSION built by the other build"
    printf '%s\n' "$HELM_BIN"
    exit 0
  fi
fi
partial=$HELM_DIR/.partial
rm -rf "$partial"
mkdir -p "$partial"
log=$TOOLS_DIR/build-helm-v$HELM_VERSION.log
module=helm.sh/helm/v$HELM_MAJOR
export GOTOOLCHAIN=local CGO_ENABLED=0
count_module_packages "resolving helm's packages" "$module@v$HELM_VERSION" \
  "$TOOLS_DIR/list-helm-v$HELM_VERSION.log" ./cmd/helm
progress "building helm v$HELM_VERSION from $module: up to ${GO_PACKAGES_TOTAL:-?} packages (cold: ~5-10 min on 2 cores; log: $log)"

# helm stamps its version through ldflags; without them `helm version` says "v4.x-dev".
ldflags="-s -w -X $module/internal/version.version=v$HELM_VERSION"
run_with_progress --total "$GO_PACKAGES_TOTAL" "helm build" "$log" \
  env GOFLAGS=-mod=mod GOBIN="$partial" \
  go install -v -trimpath -ldflags "$ldflags" "$module/cmd/helm@v$HELM_VERSION"
mv "$partial/helm" "$HELM_BIN"
rm -rf "$partial"
"$HELM_BIN" version >&2 || die "built helm does not run"
progress "helm v$HELM_VERSION installed"
printf '%s\n' "$HELM_BIN"
