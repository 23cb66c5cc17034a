#!/usr/bin/env bash
# Builds the Go reference kubelet plugin the benchmarks compare against
# (REFERENCE_MODULE / REFERENCE_VERSION in hack/versions.env) from the Go module proxy,
# with the same local Go toolchain and settings hack/local-cluster.sh builds Kubernetes
# with, into the project cache outside the repository.
#
#   hack/build-reference.sh          build unless cached; prints the binary's path last
#   hack/build-reference.sh path     print where the pinned binary lives (built or not)
#
# Cache: ${GPU_DRA_CACHE:-${XDG_CACHE_HOME:-~/.cache}/gpu-dra-driver}/bin/reference/
#        dra-example-kubeletplugin-<version>/dra-example-kubeletplugin
# A cold build takes about 6 minutes on 2 cores. The module version the binary was
# built from is checked with `go version -m` (the benchmark records it the same way).
set -euo pipefail

HACK_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=hack/versions.env
source "$HACK_DIR/versions.env"
: "${REFERENCE_MODULE:?REFERENCE_MODULE missing from hack/versions.env}"
: "${REFERENCE_VERSION:?REFERENCE_VERSION missing from hack/versions.env}"

CACHE_ROOT=${GPU_DRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-driver}
PACKAGE=$REFERENCE_MODULE/cmd/dra-example-kubeletplugin
OUT_DIR=$CACHE_ROOT/bin/reference/dra-example-kubeletplugin-v$REFERENCE_VERSION
BIN=$OUT_DIR/dra-example-kubeletplugin
LOG=$CACHE_ROOT/build-reference-v$REFERENCE_VERSION.log

START_TIME=$(date +%s)
progress() { printf '[build-reference %4ss] %s\n' "$(($(date +%s) - START_TIME))" "$*" >&2; }
die() {
  printf 'build-reference: %s\n' "$*" >&2
  exit 1
}

# True when $1 is a Go binary built from $REFERENCE_MODULE at the pinned version.
built_from_pinned_module() {
  go version -m "$1" 2>/dev/null | awk -v m="$REFERENCE_MODULE" -v v="v$REFERENCE_VERSION" \
    '($1 == "mod" || $1 == "dep") && $2 == m && $3 == v { found = 1 } END { exit !found }'
}

if [[ ${1:-} == path ]]; then
  printf '%s\n' "$BIN"
  exit 0
fi
[[ $# -eq 0 ]] || die "usage: $0 [path]"
command -v go >/dev/null || die "go is required to build the reference (go >= 1.26)"

if [[ -x $BIN ]] && built_from_pinned_module "$BIN"; then
  progress "$PACKAGE v$REFERENCE_VERSION cached"
  printf '%s\n' "$BIN"
  exit 0
fi

mkdir -p "$OUT_DIR"
partial=$OUT_DIR/.partial
rm -rf "$partial"
mkdir -p "$partial"
progress "building $PACKAGE@v$REFERENCE_VERSION (cold: ~6 min on 2 cores; log: $LOG)"
# `go install pkg@version` would ask the proxy for the module's version list (to show
# deprecations), which it refuses for this module; a throw-away wrapper module that
# requires exactly the pinned version builds the same package with the same
# dependency versions (v0.4.0's go.mod has no replace directives to lose).
src=$CACHE_ROOT/src/reference-v$REFERENCE_VERSION
mkdir -p "$src"
printf 'module local/referencebin\n\ngo 1.26.0\n\nrequire %s v%s\n' \
  "$REFERENCE_MODULE" "$REFERENCE_VERSION" >"$src/go.mod"
printf 'package tools\n' >"$src/doc.go"
(
  cd "$src"
  export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod
  go mod download "$REFERENCE_MODULE" &&
    go build -v -trimpath -o "$partial/dra-example-kubeletplugin" "$PACKAGE"
) >"$LOG" 2>&1 &
pid=$!
while kill -0 "$pid" 2>/dev/null; do
  sleep 15
  kill -0 "$pid" 2>/dev/null && progress "still building ($(grep -cv '^go: ' "$LOG" || true) packages compiled)"
done
if ! wait "$pid"; then
  tail -n 30 "$LOG" >&2
  die "build failed; full log: $LOG"
fi
built_from_pinned_module "$partial/dra-example-kubeletplugin" ||
  die "go version -m does not show $REFERENCE_MODULE v$REFERENCE_VERSION in the built binary"
mv "$partial/dra-example-kubeletplugin" "$BIN"
rm -rf "$partial"
progress "built $BIN"
printf '%s\n' "$BIN"
