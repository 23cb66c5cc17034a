#!/usr/bin/env bash
# Builds kube-network-policies (KUBE_NETWORK_POLICIES_MODULE / _VERSION in
# hack/versions.env), the NetworkPolicy implementation kind's own kindnetd embeds, from
# the Go module proxy into the project cache, outside the repository. The offline kind
# cluster has no kindnetd (its image cannot be built here), so hack/kind/network-policies.sh
# runs this binary as a DaemonSet to enforce the chart's NetworkPolicies.
#
#   hack/build-kube-network-policies.sh          build unless cached; prints the binary's path last
#   hack/build-kube-network-policies.sh path     print where the pinned binary lives (built or not)
#
# Cache: ${GPU_DRA_CACHE:-${XDG_CACHE_HOME:-~/.cache}/gpu-dra-driver}/bin/
#        kube-network-policies-v<version>/kube-network-policies
# Static (CGO_ENABLED=0: nftables and nfqueue through netlink, no C library). The module
# zip is checked against the pinned go.sum hash (KUBE_NETWORK_POLICIES_SUM) on top of
# Go's checksum database, and the built binary with `go version -m`. A cold build takes
# ~3.5 min on 2 cores (689 packages: client-go and friends at the module's own versions).
set -euo pipefail

HACK_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=hack/versions.env
source "$HACK_DIR/versions.env"
: "${KUBE_NETWORK_POLICIES_MODULE:?KUBE_NETWORK_POLICIES_MODULE missing from hack/versions.env}"
: "${KUBE_NETWORK_POLICIES_VERSION:?KUBE_NETWORK_POLICIES_VERSION missing from hack/versions.env}"
: "${KUBE_NETWORK_POLICIES_SUM:?KUBE_NETWORK_POLICIES_SUM missing from hack/versions.env}"

CACHE_ROOT=${GPU_DRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-driver}
MODULE=$KUBE_NETWORK_POLICIES_MODULE
VERSION=v$KUBE_NETWORK_POLICIES_VERSION
# The module's only command (cmd/main.go): the daemon kindnetd embeds as a library.
PACKAGE=$MODULE/cmd
OUT_DIR=$CACHE_ROOT/bin/kube-network-policies-$VERSION
BIN=$OUT_DIR/kube-network-policies
LOG=$CACHE_ROOT/build-kube-network-policies-$VERSION.log

START_TIME=$(date +%s)
progress() { printf '[build-kube-network-policies %4ss] %s\n' "$(($(date +%s) - START_TIME))" "$*" >&2; }
die() {
  printf 'build-kube-network-policies: %s\n' "$*" >&2
  exit 1
}
# shellcheck source=hack/lib/go-progress.sh
source "$HACK_DIR/lib/go-progress.sh"

# True when $1 is a Go binary built from $MODULE at the pinned version and hash.
built_from_pinned_module() {
  go version -m "$1" 2>/dev/null | awk -v m="$MODULE" -v v="$VERSION" -v s="$KUBE_NETWORK_POLICIES_SUM" \
    '($1 == "mod" || $1 == "dep") && $2 == m && $3 == v && ($4 == s || $4 == "") { found = 1 } END { exit !found }'
}

if [[ ${1:-} == path ]]; then
  printf '%s\n' "$BIN"
  exit 0
fi
[[ $# -eq 0 ]] || die "usage: $0 [path]"
command -v go >/dev/null || die "go is required to build kube-network-policies (go >= 1.23)"

if [[ -x $BIN ]] && built_from_pinned_module "$BIN"; then
  progress "$MODULE $VERSION cached"
  printf '%s\n' "$BIN"
  exit 0
fi

mkdir -p "$OUT_DIR"
# One build at a time per cache (the kind tier and a developer's make kind-up).
exec 9>"$OUT_DIR/.build.lock"
if ! flock -n 9; then
  progress "another build holds $OUT_DIR/.build.lock; waiting for it"
  flock 9
  if [[ -x $BIN ]] && built_from_pinned_module "$BIN"; then
    progress "$MODULE $VERSION built by the other build"
    printf '%s\n' "$BIN"
    exit 0
  fi
fi
partial=$OUT_DIR/.partial
rm -rf "$partial"
mkdir -p "$partial"
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod

# The module zip, verified by `go mod download` against Go's checksum database
# (GOSUMDB), and here against the hash pinned in hack/versions.env as well.
progress "downloading $MODULE@$VERSION from the Go module proxy"
sum=$(cd / && go mod download -json "$MODULE@$VERSION" |
  sed -n 's/^[[:space:]]*"Sum": "\(.*\)",\{0,1\}$/\1/p') || die "go mod download $MODULE@$VERSION failed"
[[ $sum == "$KUBE_NETWORK_POLICIES_SUM" ]] ||
  die "$MODULE@$VERSION has hash '${sum:-none}', hack/versions.env pins $KUBE_NETWORK_POLICIES_SUM"

# A throw-away wrapper module that requires exactly the pinned version builds the
# command with the module's own dependency versions (its go.mod has no replace
# directives to lose), as hack/build-reference.sh does; its go.sum is written from the
# checksum database.
src=$CACHE_ROOT/src/kube-network-policies-$VERSION
mkdir -p "$src"
printf 'module local/kubenetworkpoliciesbin\n\ngo 1.26.0\n\nrequire %s %s\n' "$MODULE" "$VERSION" >"$src/go.mod"
printf 'package tools\n' >"$src/doc.go"
(cd "$src" && go mod download "$MODULE") >"$LOG" 2>&1 ||
  { tail -n 20 "$LOG" >&2; die "module download failed; full log: $LOG"; }
count_go_packages "resolving the kube-network-policies packages" "$src" \
  "$CACHE_ROOT/list-kube-network-policies-$VERSION.log" "$PACKAGE"
progress "building $PACKAGE@$VERSION: up to ${GO_PACKAGES_TOTAL:-?} packages (cold: ~3.5 min on 2 cores; log: $LOG)"
run_with_progress --total "$GO_PACKAGES_TOTAL" "kube-network-policies build" "$LOG" \
  bash -c "cd '$src' && go build -v -trimpath -ldflags '-s -w' -o '$partial/kube-network-policies' '$PACKAGE'"
built_from_pinned_module "$partial/kube-network-policies" ||
  die "go version -m does not show $MODULE $VERSION ($KUBE_NETWORK_POLICIES_SUM) in the built binary"
if readelf -lW "$partial/kube-network-policies" 2>/dev/null | grep -q 'program interpreter'; then
  die "the built kube-network-policies is not static"
fi
mv "$partial/kube-network-policies" "$BIN"
rm -rf "$partial"
exec 9>&-
progress "built $BIN"
printf '%s\n' "$BIN"
