#!/usr/bin/env bash
# Builds the KEP-5322 prototype kubelet: the pinned upstream kubelet (K8S_VERSION in
# hack/versions.env) with hack/patches/*.patch applied, into the project cache next to
# the upstream binaries. docs/kep-5322.md describes the patches.
#
#   hack/build-kubelet-kep5322.sh        build unless cached; prints the binary's path last
#   hack/build-kubelet-kep5322.sh path   print where the binary for these patches lives
#
# Cache: ${GPU_DRA_CACHE:-~/.cache/gpu-dra-driver}/bin/kubelet-kep5322/
#        k8s-<version>-<hash of the patches>/kubelet
#
# The patches are written against the kubernetes repository's layout (they apply to a
# checkout with `git apply`): staging/src/k8s.io/<module>/... is the published module
# k8s.io/<module>@v0.<minor>.<patch>, everything else is k8s.io/kubernetes@v<version>.
# The modules the patches touch are copied out of the Go module cache into
# src/kubelet-kep5322-k8s-<version>-<hash>/ in that layout and patched there; a wrapper
# module like the upstream build's (hack/lib/build.sh: same tags and version ldflags)
# replaces them with the copies. Packages of other modules come from the Go build cache;
# those of the copied modules and their importers are compiled (2 cores: 2 min 49 s the
# first time, with the upstream kubelet's packages in the Go build cache; 28 s for a
# clean binary and source cache once the Go build cache has the patched packages).
# (`go build -overlay` would compile even less, but Go refuses to overlay files in the
# module cache.)
# A patched api.proto gets its api.pb.go regenerated with the protoc-gen-go version
# named in the upstream file's header (from the Go module proxy) and the protoc of
# the Python grpcio-tools in .venv (made first when missing: hack/lib/venv.sh); the generator is checked first by
# regenerating the unpatched file.
set -euo pipefail

HACK_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HACK_DIR")
# shellcheck source=hack/lib/common.sh
source "$HACK_DIR/lib/common.sh"
# shellcheck source=hack/lib/build.sh
source "$HACK_DIR/lib/build.sh"
# shellcheck source=hack/lib/venv.sh
source "$HACK_DIR/lib/venv.sh"
progress() { printf '[kubelet-kep5322 %4ss] %s\n' "$(elapsed)" "$*" >&2; }
die() {
  printf 'build-kubelet-kep5322: %s\n' "$*" >&2
  exit 1
}

PATCH_DIR=${GPU_DRA_KEP5322_PATCHES:-$HACK_DIR/patches}
GATE=DRAHandlePermanentDriverFailures

shopt -s nullglob
PATCHES=("$PATCH_DIR"/*.patch)
shopt -u nullglob
((${#PATCHES[@]} > 0)) || die "no patches in $PATCH_DIR"
PATCH_HASH=$(cat "${PATCHES[@]}" | sha256sum | cut -c1-12)
KEY=k8s-$K8S_VERSION-$PATCH_HASH
OUT_DIR=$CACHE_ROOT/bin/kubelet-kep5322/$KEY
BIN=$OUT_DIR/kubelet
TREE=$SRC_DIR/kubelet-kep5322-$KEY
LOG=$CACHE_ROOT/build-kubelet-kep5322.log         # the go build
PREP_LOG=$CACHE_ROOT/build-kubelet-kep5322-prepare.log # the steps before it

# The repository paths a patch touches (its "+++ b/..." lines).
patched_paths() {
  sed -n 's|^+++ b/\([^[:space:]]*\).*|\1|p' "$@" | sort -u
}

# The module a path of the kubernetes repository belongs to, and its directory there.
module_of() {
  local path=$1 rest
  if [[ $path == staging/src/k8s.io/* ]]; then
    rest=${path#staging/src/k8s.io/}
    printf 'k8s.io/%s staging/src/k8s.io/%s' "${rest%%/*}" "${rest%%/*}"
  else
    printf 'k8s.io/kubernetes .'
  fi
}

# The protoc-gen-go a generated file names in its header ("protoc-gen-go v1.36.11").
protoc_gen_go() {
  local pbgo=$1 version bin
  version=$(sed -n 's|^//[[:space:]]*protoc-gen-go[[:space:]]\{1,\}\(v[0-9.]*\)$|\1|p' "$pbgo" | head -n 1)
  [[ -n $version ]] || die "$pbgo names no protoc-gen-go version (not made by protoc-gen-go?)"
  bin=$CACHE_ROOT/bin/tools/protoc-gen-go-$version/protoc-gen-go
  if [[ ! -x $bin ]]; then
    progress "go install google.golang.org/protobuf/cmd/protoc-gen-go@$version"
    GOBIN=$(dirname "$bin") nice -n 10 go install "google.golang.org/protobuf/cmd/protoc-gen-go@$version" >>"$PREP_LOG" 2>&1 ||
      die "go install protoc-gen-go@$version failed; log: $PREP_LOG"
  fi
  printf '%s' "$bin"
}

# generate ROOT PROTO PLUGIN UPSTREAM_PB_GO: ROOT/PROTO's .pb.go, run from the repository
# root as upstream does (the descriptor names the file by its repository path), with
# upstream's license boilerplate (the block comment and a blank line) in front.
generate() {
  local root=$1 proto=$2 plugin=$3 upstream=$4 out generated
  out=$root/${proto%.proto}.pb.go
  (cd "$root" && "$PYTHON" -m grpc_tools.protoc -I . --plugin=protoc-gen-go="$plugin" \
    --go_out=paths=source_relative:. "$proto") >>"$PREP_LOG" 2>&1 || die "protoc failed for $proto; log: $PREP_LOG"
  generated=$(cat "$out")
  { awk '{ print } /^\*\/$/ { getline; print; exit }' "$upstream"; printf '%s\n' "$generated"; } >"$out"
}

# regenerate_pb_go TREE PROTO: TREE/PROTO's .pb.go, after checking the generator: the
# unpatched proto gives back the upstream file (up to the line naming protoc's version).
regenerate_pb_go() {
  local tree=$1 proto=$2 upstream plugin check protoc_line='^//[[:space:]]*protoc[[:space:]]'
  upstream=$(upstream_file "${proto%.proto}.pb.go")
  plugin=$(protoc_gen_go "$upstream")
  "$PYTHON" -m grpc_tools.protoc --version >/dev/null 2>&1 ||
    die "$PYTHON -m grpc_tools.protoc does not run (make venv installs grpcio-tools)"
  check=$(mktemp -d)
  mkdir -p "$check/$(dirname "$proto")"
  cp "$(upstream_file "$proto")" "$check/$proto"
  generate "$check" "$proto" "$plugin" "$upstream"
  if ! diff -q <(grep -v "$protoc_line" "$upstream") <(grep -v "$protoc_line" "$check/${proto%.proto}.pb.go") >/dev/null; then
    rm -rf "$check"
    die "regenerating the unpatched $proto does not reproduce upstream's $(basename "$upstream"): generator mismatch"
  fi
  rm -rf "$check"
  generate "$tree" "$proto" "$plugin" "$upstream"
  progress "regenerated ${proto%.proto}.pb.go ($(sed -n 's|^//[[:space:]]*\(protoc-gen-go[[:space:]].*\)|\1|p' "$upstream"))"
}

# The patched modules, laid out as the kubernetes repository (k8s.io/kubernetes at the
# root, k8s.io/<module> under staging/src/), so that the patches apply with -p1.
copy_modules() {
  local wrapper=$1 path module dir src
  rm -rf "$TREE"
  declare -gA PATCHED_MODULES=() MODULE_SOURCES=()
  while read -r path; do
    read -r module dir <<<"$(module_of "$path")"
    [[ -n ${PATCHED_MODULES[$module]:-} ]] && continue
    PATCHED_MODULES[$module]=$dir
    src=$(cd "$wrapper" && go list -m -f '{{.Dir}}' "$module") || src=""
    [[ -n $src ]] ||
      die "module $module (for $path) is not part of the build of k8s.io/kubernetes v$K8S_VERSION"
    MODULE_SOURCES[$dir]=$src
    mkdir -p "$TREE/$dir"
    cp -R "$src/." "$TREE/$dir/"
  done < <(patched_paths "${PATCHES[@]}")
  chmod -R u+w "$TREE"
}

# upstream_file PATH: the unpatched file in the module cache.
upstream_file() {
  local dir
  read -r _ dir <<<"$(module_of "$1")"
  printf '%s/%s' "${MODULE_SOURCES[$dir]}" "${1#"$dir"/}"
}

# The upstream wrapper module (hack/lib/build.sh) with the patched modules replaced by
# their copies.
write_wrapper() {
  local upstream=$1 wrapper=$2 module dir
  mkdir -p "$wrapper"
  cp "$upstream/go.sum" "$upstream/doc.go" "$wrapper/"
  {
    grep -v -E "^\s*($(printf '%s|' "${!PATCHED_MODULES[@]}" | sed 's/|$//; s/\./\\./g')) =>" "$upstream/go.mod"
    printf '\nreplace (\n'
    for module in "${!PATCHED_MODULES[@]}"; do
      dir=$TREE/${PATCHED_MODULES[$module]}
      printf '\t%s => %s\n' "$module" "${dir%/.}"
    done
    printf ')\n'
  } >"$wrapper/go.mod"
}

build() {
  local upstream=$SRC_DIR/k8s-$K8S_VERSION wrapper=$TREE.wrapper path p
  progress "resolving k8s.io/kubernetes v$K8S_VERSION modules"
  write_k8s_wrapper "$upstream"
  (cd "$upstream" && go mod download k8s.io/kubernetes) >>"$PREP_LOG" 2>&1 || die "module download failed; log: $PREP_LOG"
  # Older trees (other patches) are not needed any more: ~130 MB each.
  rm -rf "$SRC_DIR"/kubelet-kep5322-k8s-*
  copy_modules "$upstream"
  progress "copied ${!PATCHED_MODULES[*]} to $TREE"
  for p in "${PATCHES[@]}"; do
    patch -p1 --batch --forward --fuzz=0 --no-backup-if-mismatch -d "$TREE" <"$p" >>"$PREP_LOG" 2>&1 ||
      die "$(basename "$p") does not apply to v$K8S_VERSION (log: $PREP_LOG)"
    progress "applied $(basename "$p")"
  done
  while read -r path; do
    [[ $path == *.proto ]] && regenerate_pb_go "$TREE" "$path"
  done < <(patched_paths "${PATCHES[@]}")
  write_wrapper "$upstream" "$wrapper"

  local pkg=k8s.io/kubernetes/cmd/kubelet tags=selinux,notest,grpcnotrace
  count_go_packages "resolving the kubelet packages" "$wrapper" "$CACHE_ROOT/list-kubelet-kep5322.log" -tags "$tags" "$pkg"
  progress "compiling the patched kubelet: up to ${GO_PACKAGES_TOTAL:-?} packages; those of the patched modules and their importers are compiled (2 cores: ~3 min the first time, seconds once the Go build cache has them)"
  local tmp=$OUT_DIR.partial
  rm -rf "$tmp"
  mkdir -p "$tmp"
  run_with_progress --total "$GO_PACKAGES_TOTAL" "kubelet-kep5322 build" "$LOG" \
    bash -c "cd '$wrapper' && nice -n 10 go build -v -trimpath -tags $tags -ldflags '$(version_ldflags)' -o '$tmp/kubelet' $pkg"
  check_binary "$tmp/kubelet"
  printf '%s\n' "${PATCHES[@]##*/}" >"$tmp/patches.txt"
  rm -rf "$OUT_DIR"
  mv "$tmp" "$OUT_DIR"
}

check_binary() {
  local v help
  v=$("$1" --version) || die "$1 --version failed"
  [[ $v == *"v$K8S_VERSION"* ]] || die "the prototype kubelet is not stamped v$K8S_VERSION: $v"
  help=$("$1" --help 2>&1 || true)
  [[ $help == *"$GATE=true|false (ALPHA"* ]] || die "the prototype kubelet does not know the feature gate $GATE"
}

main() {
  case ${1:-} in
    path)
      printf '%s\n' "$BIN"
      return
      ;;
    "") ;;
    *) die "usage: $0 [path]" ;;
  esac
  if [[ -x $BIN ]]; then
    progress "cached: $BIN (patches $PATCH_HASH)"
    printf '%s\n' "$BIN"
    return
  fi
  command -v go >/dev/null || die "go (>= 1.26) is required to build the prototype kubelet"
  command -v patch >/dev/null || die "patch is required (apt-get install patch)"
  PYTHON=$(project_python "$REPO") # its grpcio-tools' protoc regenerates a patched api.pb.go
  mkdir -p "$CACHE_ROOT" "$SRC_DIR"
  : >"$PREP_LOG"
  # The upstream builds share the Go build cache and the wrapper module; one at a time.
  exec 9>"$CACHE_ROOT/build.lock"
  if ! flock -n 9; then
    progress "another build holds $CACHE_ROOT/build.lock; waiting for it"
    flock 9
  fi
  if [[ ! -x $BIN ]]; then
    progress "building the KEP-5322 prototype kubelet v$K8S_VERSION with ${#PATCHES[@]} patches (hash $PATCH_HASH; log: $LOG)"
    build
  fi
  exec 9>&-
  progress "prototype kubelet: $BIN"
  printf '%s\n' "$BIN"
}

main "$@"
