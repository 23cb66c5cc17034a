#!/usr/bin/env bash
# Builds hack/nvml-standin, the test stand-in for libnvidia-ml.so.1 that lets NVIDIA's
# Go CDI generator (nvidia-ctk cdi generate --mode nvml, cmd/gpu-dra-cdi-common) run on
# a fake driver root (tests/integration/test_cdi_generator.py), as a C shared library
# with the local Go toolchain.
#
#   hack/build-nvml-standin.sh          build unless cached; prints the library's path last
#   hack/build-nvml-standin.sh path     print where the library for these sources lives
#
# Cache: ${GPU_DRA_CACHE:-${XDG_CACHE_HOME:-~/.cache}/gpu-dra-driver}/bin/
#        nvml-standin-<hash>/libnvidia-ml.so
# where <hash> covers the stand-in's sources and the Go version: an edit rebuilds, a
# second run is a no-op. A cold build takes well under a minute (no dependencies).
set -euo pipefail

HACK_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SRC=$HACK_DIR/nvml-standin
CACHE_ROOT=${GPU_DRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-driver}

START_TIME=$(date +%s)
progress() { printf '[build-nvml-standin %4ss] %s\n' "$(($(date +%s) - START_TIME))" "$*" >&2; }
die() {
  printf 'build-nvml-standin: %s\n' "$*" >&2
  exit 1
}

[[ $# -eq 0 || ${1:-} == path ]] || die "usage: $0 [path]"
command -v go >/dev/null || die "go is required to build the NVML stand-in (go >= 1.26, cgo)"
export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=1

# The key: every source file (sorted, name and content) plus the toolchain.
hash=$(
  cd "$SRC"
  {
    go version
    find . -type f \( -name '*.go' -o -name 'go.mod' -o -name 'go.sum' \) | LC_ALL=C sort |
      while IFS= read -r f; do
        printf '%s\n' "$f"
        cat "$f"
      done
  } | sha256sum | cut -c1-12
)
OUT_DIR=$CACHE_ROOT/bin/nvml-standin-$hash
LIB=$OUT_DIR/libnvidia-ml.so

if [[ ${1:-} == path ]]; then
  printf '%s\n' "$LIB"
  exit 0
fi

if [[ -f $LIB ]]; then
  progress "nvml-standin-$hash cached"
  printf '%s\n' "$LIB"
  exit 0
fi

command -v "${CC:-cc}" >/dev/null || die "a C compiler (${CC:-cc}) is required: cgo builds the stand-in"
mkdir -p "$OUT_DIR"
# One build at a time (a test session and a developer): the second finds it built.
exec 9>"$OUT_DIR/.lock"
flock 9
if [[ -f $LIB ]]; then
  progress "nvml-standin-$hash built meanwhile"
  printf '%s\n' "$LIB"
  exit 0
fi
partial=$OUT_DIR/.partial
rm -rf "$partial"
mkdir -p "$partial"
LOG=$CACHE_ROOT/build-nvml-standin-$hash.log
progress "building $SRC -> $LIB (log: $LOG)"
# The SONAME a real libnvidia-ml.so.<version> carries; nvcdi reads it for the symlinks
# it asks nvidia-cdi-hook to create.
if ! (cd "$SRC" && go build -trimpath -buildmode=c-shared \
  -ldflags='-extldflags=-Wl,-soname,libnvidia-ml.so.1' \
  -o "$partial/libnvidia-ml.so" .) >"$LOG" 2>&1; then
  tail -n 30 "$LOG" >&2
  die "build failed; full log: $LOG"
fi
mv "$partial/libnvidia-ml.so" "$LIB"
rm -rf "$partial"
progress "built $LIB"
printf '%s\n' "$LIB"
