#!/usr/bin/env bash
# Builds NVIDIA's CDI tooling at the pinned NVIDIA Container Toolkit version
# (NVIDIA_CTK_VERSION in hack/versions.env, module github.com/NVIDIA/nvidia-container-toolkit)
# and our cmd/gpu-dra-cdi-common (nvcdi's common CDI edits as JSON) from the Go module
# proxy into the project cache, outside the repository:
#
#   nvidia-ctk          cgo, dynamically linked against glibc (tests and the image run it)
#   nvidia-cdi-hook     cgo, static: CDI hooks run it on the host, outside any image
#   gpu-dra-cdi-common  cgo, dynamic: go-nvml dlopens libnvidia-ml.so.1 from the driver
#                       root, which a static glibc binary cannot do reliably
#
#   hack/build-nvidia-tools.sh        build unless cached; prints the bin directory last
#   hack/build-nvidia-tools.sh path   print the bin directory (built or not)
#
# Cache: ${GPU_DRA_CACHE:-${XDG_CACHE_HOME:-~/.cache}/gpu-dra-driver}/bin/nvidia-toolkit-<version>/
# Stamps there record the toolkit version and a hash of cmd/gpu-dra-cdi-common's sources,
# each with a hash of this script: a changed source rebuilds gpu-dra-cdi-common only, a
# changed version or script all three; a cached run takes a few milliseconds. A cold
# build takes ~2-3 min on 2 cores (plus module downloads), seconds with a warm Go cache.
# Needs go >= 1.26, gcc, and glibc's static libraries (libc6-dev) for nvidia-cdi-hook.
set -euo pipefail

HACK_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$HACK_DIR/.." && pwd)
# shellcheck source=hack/versions.env
source "$HACK_DIR/versions.env"
: "${NVIDIA_CTK_VERSION:?NVIDIA_CTK_VERSION missing from hack/versions.env}"

CACHE_ROOT=${GPU_DRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-driver}
BIN_DIR=$CACHE_ROOT/bin/nvidia-toolkit-$NVIDIA_CTK_VERSION
SRC_DIR=$CACHE_ROOT/src/nvidia-toolkit-$NVIDIA_CTK_VERSION
COMMON_SRC=$REPO_DIR/cmd/gpu-dra-cdi-common
LOG=$CACHE_ROOT/build-nvidia-tools-$NVIDIA_CTK_VERSION.log
MODULE=github.com/NVIDIA/nvidia-container-toolkit

START_TIME=$(date +%s)
progress() { printf '[build-nvidia-tools %4ss] %s\n' "$(($(date +%s) - START_TIME))" "$*" >&2; }
die() {
  printf 'build-nvidia-tools: %s\n' "$*" >&2
  exit 1
}

if [[ ${1:-} == path ]]; then
  printf '%s\n' "$BIN_DIR"
  exit 0
fi
[[ $# -eq 0 ]] || die "usage: $0 [path]"

hash_files() { sha256sum "$@" | sha256sum | cut -c1-16; }
recipe=$(hash_files "${BASH_SOURCE[0]}")
# The hook binary and the nvcdi library that writes the hooks come from one version.
grep -qE "^\s*(require\s+)?$MODULE v$NVIDIA_CTK_VERSION\s*(//.*)?$" "$COMMON_SRC/go.mod" ||
  die "$COMMON_SRC/go.mod does not require $MODULE v$NVIDIA_CTK_VERSION (hack/versions.env)"
common_files=()
while IFS= read -r -d '' f; do common_files+=("$f"); done < <(
  find "$COMMON_SRC" -type f \( -name '*.go' -o -name go.mod -o -name go.sum \) -print0 | LC_ALL=C sort -z
)
TOOLKIT_KEY="$MODULE v$NVIDIA_CTK_VERSION recipe $recipe"
COMMON_KEY="cmd/gpu-dra-cdi-common $(hash_files "${common_files[@]}") recipe $recipe"

# up_to_date <stamp> <key> <binary>...: the stamp holds the key and every binary exists.
up_to_date() {
  local stamp=$BIN_DIR/.$1.stamp key=$2 b
  shift 2
  [[ -f $stamp && $(<"$stamp") == "$key" ]] || return 1
  for b in "$@"; do [[ -x $BIN_DIR/$b ]] || return 1; done
}
toolkit_cached() { up_to_date toolkit "$TOOLKIT_KEY" nvidia-ctk nvidia-cdi-hook; }
common_cached() { up_to_date cdi-common "$COMMON_KEY" gpu-dra-cdi-common; }

if toolkit_cached && common_cached; then
  progress "nvidia-ctk, nvidia-cdi-hook v$NVIDIA_CTK_VERSION and gpu-dra-cdi-common cached"
  printf '%s\n' "$BIN_DIR"
  exit 0
fi

command -v go >/dev/null || die "go is required to build the NVIDIA tools (go >= 1.26)"
command -v gcc >/dev/null || die "gcc is required (cgo: go-nvml)"
mkdir -p "$CACHE_ROOT" "$BIN_DIR"
# One build at a time per cache (parallel make targets, or a test and a developer).
exec 9>"$CACHE_ROOT/build-nvidia-tools.lock"
if ! flock -n 9; then
  progress "another build holds $CACHE_ROOT/build-nvidia-tools.lock; waiting for it"
  flock 9
fi
partial=$BIN_DIR/.partial
rm -rf "$partial"
mkdir -p "$partial"
: >"$LOG"
export GOTOOLCHAIN=local CGO_ENABLED=1

# run_logged <what> <command...>: runs in the background with its output in $LOG,
# reporting the packages compiled so far every 15 s (`go build -v` lists them).
run_logged() {
  local what=$1 pid waited=0
  shift
  "$@" >>"$LOG" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    ((++waited % 15 == 0)) && kill -0 "$pid" 2>/dev/null &&
      progress "still building $what ($(grep -cEv '^(go: |#|cgo-gcc-prolog|/|In file| )' "$LOG" || true) packages compiled)"
  done
  if ! wait "$pid"; then
    tail -n 30 "$LOG" >&2
    die "$what failed; full log: $LOG"
  fi
}

if ! toolkit_cached; then
  progress "building nvidia-ctk and nvidia-cdi-hook from $MODULE@v$NVIDIA_CTK_VERSION (cold: ~2-3 min on 2 cores; log: $LOG)"
  # The toolkit's go.mod has no replace directives, so a throw-away wrapper module that
  # requires exactly the pinned version builds its commands with its own dependency
  # versions (as hack/lib/build.sh does for Kubernetes).
  mkdir -p "$SRC_DIR"
  printf 'module local/nvidiatoolkitbin\n\ngo 1.26.0\n\nrequire %s v%s\n' "$MODULE" "$NVIDIA_CTK_VERSION" >"$SRC_DIR/go.mod"
  printf 'package tools\n' >"$SRC_DIR/doc.go"
  # The toolkit's Makefile stamps the version the same way (`nvidia-ctk --version`).
  ldflags="-s -w -X $MODULE/internal/info.version=$NVIDIA_CTK_VERSION"
  export GOFLAGS="-mod=mod -buildvcs=false"
  run_logged "module download" bash -c "cd '$SRC_DIR' && go mod download $MODULE"
  run_logged nvidia-ctk bash -c "cd '$SRC_DIR' && go build -v -trimpath -ldflags '$ldflags' \
    -o '$partial/nvidia-ctk' $MODULE/cmd/nvidia-ctk"
  # Static glibc warns that dlopen/getaddrinfo need the same glibc at run time. Of the
  # hooks only apply-cuda-memory-limits dlopens NVML, and nvcdi's common and device
  # edits never emit it (only per-device CUDA memory limits do); none resolves names.
  run_logged nvidia-cdi-hook bash -c "cd '$SRC_DIR' && go build -v -trimpath \
    -ldflags '$ldflags -linkmode external -extldflags -static' \
    -o '$partial/nvidia-cdi-hook' $MODULE/cmd/nvidia-cdi-hook"
  if readelf -lW "$partial/nvidia-cdi-hook" | grep -q 'program interpreter'; then
    die "nvidia-cdi-hook is not static (is libc6-dev installed?)"
  fi
  for b in nvidia-ctk nvidia-cdi-hook; do
    "$partial/$b" --version 2>&1 | grep -qF "$NVIDIA_CTK_VERSION" ||
      die "$b --version does not report $NVIDIA_CTK_VERSION: $("$partial/$b" --version 2>&1 | head -n 1)"
    mv "$partial/$b" "$BIN_DIR/$b"
  done
  printf '%s' "$TOOLKIT_KEY" >"$BIN_DIR/.toolkit.stamp"
fi

if ! common_cached; then
  progress "building gpu-dra-cdi-common from $COMMON_SRC"
  # -mod=readonly: the committed go.mod/go.sum must be complete; a build never edits them.
  export GOFLAGS="-mod=readonly -buildvcs=false"
  run_logged gpu-dra-cdi-common bash -c "cd '$COMMON_SRC' && go build -v -trimpath -ldflags '-s -w' \
    -o '$partial/gpu-dra-cdi-common' ."
  mv "$partial/gpu-dra-cdi-common" "$BIN_DIR/gpu-dra-cdi-common"
  printf '%s' "$COMMON_KEY" >"$BIN_DIR/.cdi-common.stamp"
fi

rm -rf "$partial"
exec 9>&-
progress "built nvidia-ctk, nvidia-cdi-hook v$NVIDIA_CTK_VERSION and gpu-dra-cdi-common in $BIN_DIR"
printf '%s\n' "$BIN_DIR"
