# shellcheck shell=bash
# `build`: etcd and the Kubernetes binaries, compiled from upstream Go modules into a
# cache outside the repository (keyed by the versions in hack/versions.env).

export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0

# shellcheck source=hack/lib/go-progress.sh
source "$HACK_DIR/lib/go-progress.sh"

version_ldflags() {
  local v=v$K8S_VERSION minor now pkg flags="-s -w"
  minor=$(cut -d. -f2 <<<"$K8S_VERSION")
  now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    flags+=" -X $pkg.gitVersion=$v -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    flags+=" -X $pkg.gitCommit=0000000000000000000000000000000000000000"
    flags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$now"
  done
  printf '%s' "$flags"
}

# k8s.io/kubernetes cannot be `go install`ed: it requires its staging modules at
# v0.0.0 through replace directives that Go ignores in a dependency. A wrapper module
# replaces each staging module with its published v0.<minor>.<patch> instead.
write_k8s_wrapper() {
  local dir=$1 gomod staging
  mkdir -p "$dir"
  gomod=$(go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  staging=$(grep -E '^\s*k8s\.io/[a-z0-9-]+ v0\.0\.0\s*$' "$gomod" | awk '{print $1}' | sort -u)
  {
    printf 'module local/k8sbin\n\ngo 1.26.0\n\nrequire k8s.io/kubernetes v%s\n\nreplace (\n' "$K8S_VERSION"
    local m
    for m in $staging; do printf '\t%s => %s v0.%s\n' "$m" "$m" "${K8S_VERSION#*.}"; done
    printf ')\n'
  } >"$dir/go.mod"
  printf 'package tools\n' >"$dir/doc.go"
}

build_k8s() {
  local wanted=("$@") pkgs=() b
  for b in "${wanted[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
  local dir=$SRC_DIR/k8s-$K8S_VERSION
  progress "resolving k8s.io/kubernetes v$K8S_VERSION modules (first time: downloads ~1 GB)"
  write_k8s_wrapper "$dir"
  (cd "$dir" && go mod download k8s.io/kubernetes) || die "module download failed"
  count_go_packages "resolving the kubernetes packages" "$dir" "$CACHE_ROOT/list-k8s.log" \
    -tags selinux,notest,grpcnotrace "${pkgs[@]}"
  progress "compiling ${wanted[*]}: up to ${GO_PACKAGES_TOTAL:-?} packages (2 cores: ~35 min cold, ~2 min with a warm Go build cache)"
  local tmp=$BIN_DIR.partial
  mkdir -p "$tmp"
  run_with_progress --total "$GO_PACKAGES_TOTAL" "kubernetes build" "$CACHE_ROOT/build-k8s.log" \
    bash -c "cd '$dir' && go build -v -trimpath -tags selinux,notest,grpcnotrace -ldflags '$(version_ldflags)' -o '$tmp/' ${pkgs[*]}"
  mkdir -p "$BIN_DIR"
  for b in "${wanted[@]}"; do mv "$tmp/$b" "$BIN_DIR/$b"; done
}

build_etcd() {
  local dir=$SRC_DIR/etcd-$ETCD_VERSION
  mkdir -p "$dir"
  printf 'module local/etcdbin\n\ngo 1.26.0\n\nrequire go.etcd.io/etcd/server/v3 v%s\n' "$ETCD_VERSION" >"$dir/go.mod"
  printf 'package tools\n' >"$dir/doc.go"
  count_go_packages "resolving the etcd packages" "$dir" "$CACHE_ROOT/list-etcd.log" go.etcd.io/etcd/server/v3
  progress "compiling etcd v$ETCD_VERSION: up to ${GO_PACKAGES_TOTAL:-?} packages"
  mkdir -p "$BIN_DIR"
  run_with_progress --total "$GO_PACKAGES_TOTAL" "etcd build" "$CACHE_ROOT/build-etcd.log" \
    bash -c "cd '$dir' && go build -v -trimpath -ldflags '-s -w' -o '$BIN_DIR/etcd.partial' go.etcd.io/etcd/server/v3"
  mv "$BIN_DIR/etcd.partial" "$BIN_DIR/etcd"
}

cmd_build() {
  mkdir -p "$CACHE_ROOT" "$SRC_DIR"
  # One build at a time per cache (e.g. `make cluster-build` in two shells, or `up`
  # triggering a build while another one runs).
  exec 9>"$CACHE_ROOT/build.lock"
  if ! flock -n 9; then
    progress "another build holds $CACHE_ROOT/build.lock; waiting for it"
    flock 9
  fi
  if have_binaries "${CONTROL_PLANE_BINARIES[@]}"; then
    progress "control-plane binaries cached in $BIN_DIR"
  else
    command -v go >/dev/null || die "go is required to build the cluster binaries (go >= 1.26); missing: $(missing_binaries "${CONTROL_PLANE_BINARIES[@]}" | tr '\n' ' ')"
    have_binaries etcd || build_etcd
    local missing=() b
    for b in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
      have_binaries "$b" || missing+=("$b")
    done
    ((${#missing[@]} == 0)) || build_k8s "${missing[@]}"
  fi
  "$BIN_DIR/kube-apiserver" --version | grep -q "v$K8S_VERSION" || die "kube-apiserver is not stamped v$K8S_VERSION"
  exec 9>&-
  progress "build done: $(du -sh "$BIN_DIR" | cut -f1) of binaries in $BIN_DIR"
}
