# shellcheck shell=bash
# `build` for the real node: kubelet (same wrapper module and ldflags as the control
# plane, hack/lib/build.sh), containerd + shim + ctr, runc, and the Debian packages the
# node needs. Binaries go to caches outside the repository, keyed by the versions in
# hack/versions.env. Sourced by hack/lib/node.sh, never executed.

NODE_BIN_DIR=$CACHE_ROOT/bin/containerd-$CONTAINERD_VERSION-runc-$RUNC_VERSION
RUNTIME_BINARIES=(containerd containerd-shim-runc-v2 ctr runc)
# Debian packages: CNI plugins (/usr/lib/cni), libseccomp for runc's seccomp support,
# busybox-static for the test image, debootstrap for the driver image, socat for the
# in-cluster API endpoint, gcc for the pause binary.
NODE_APT_PACKAGES=(containernetworking-plugins libseccomp-dev pkg-config busybox-static debootstrap socat gcc libc6-dev)

node_apt_missing() {
  local p out=()
  for p in "${NODE_APT_PACKAGES[@]}"; do
    [[ $(dpkg-query -W -f='${Status}' "$p" 2>/dev/null) == *"install ok installed"* ]] || out+=("$p")
  done
  printf '%s\n' "${out[@]}"
}

ensure_node_packages() {
  local missing
  missing=$(node_apt_missing | tr '\n' ' ')
  [[ -z ${missing// /} ]] && return 0
  command -v apt-get >/dev/null || die "missing Debian packages and no apt-get: $missing"
  progress "apt-get install $missing"
  # shellcheck disable=SC2086  # word splitting wanted
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing; } \
    >"$CACHE_ROOT/apt-node.log" 2>&1 || { tail -n 20 "$CACHE_ROOT/apt-node.log" >&2; die "apt-get install failed: $missing"; }
}

have_runtime_binaries() {
  local b
  for b in "${RUNTIME_BINARIES[@]}"; do [[ -x $NODE_BIN_DIR/$b ]] || return 1; done
}

# containerd's go.mod has no replace directives: `go install pkg@version` works.
build_containerd() {
  local v=v$CONTAINERD_VERSION tmp=$NODE_BIN_DIR.partial
  mkdir -p "$tmp"
  CGO_ENABLED=0 count_module_packages "resolving the containerd packages" \
    "github.com/containerd/containerd/v2@$v" "$CACHE_ROOT/list-containerd.log" \
    -tags "no_btrfs urfave_cli_no_docs" ./cmd/containerd ./cmd/containerd-shim-runc-v2 ./cmd/ctr
  progress "compiling containerd $v, containerd-shim-runc-v2, ctr: up to ${GO_PACKAGES_TOTAL:-?} packages (cold: 5-10 min)"
  run_with_progress --total "$GO_PACKAGES_TOTAL" "containerd build" "$CACHE_ROOT/build-containerd.log" \
    env CGO_ENABLED=0 GOBIN="$tmp" go install -v -trimpath -tags "no_btrfs urfave_cli_no_docs" \
    -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=$v" \
    "github.com/containerd/containerd/v2/cmd/containerd@$v" \
    "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$v" \
    "github.com/containerd/containerd/v2/cmd/ctr@$v"
  mkdir -p "$NODE_BIN_DIR"
  local b
  for b in containerd containerd-shim-runc-v2 ctr; do mv "$tmp/$b" "$NODE_BIN_DIR/$b"; done
}

# runc needs cgo (nsenter is C) and libseccomp for the seccomp tag. The optional
# libpathrs tag (a Rust library Debian lacks) is left out: runc then uses its pure-Go
# path handling.
build_runc() {
  local v=v$RUNC_VERSION tmp=$NODE_BIN_DIR.partial
  mkdir -p "$tmp"
  CGO_ENABLED=1 count_module_packages "resolving the runc packages" \
    "github.com/opencontainers/runc@$v" "$CACHE_ROOT/list-runc.log" -tags "seccomp urfave_cli_no_docs" .
  progress "compiling runc $v (cgo, seccomp): up to ${GO_PACKAGES_TOTAL:-?} packages"
  run_with_progress --total "$GO_PACKAGES_TOTAL" "runc build" "$CACHE_ROOT/build-runc.log" \
    env CGO_ENABLED=1 GOBIN="$tmp" go install -v -trimpath -tags "seccomp urfave_cli_no_docs" \
    -ldflags "-s -w" "github.com/opencontainers/runc@$v"
  mkdir -p "$NODE_BIN_DIR"
  mv "$tmp/runc" "$NODE_BIN_DIR/runc"
}

cmd_build_node() {
  mkdir -p "$CACHE_ROOT" "$SRC_DIR"
  exec 8>"$CACHE_ROOT/build-node.lock"
  if ! flock -n 8; then
    progress "another node build holds $CACHE_ROOT/build-node.lock; waiting for it"
    flock 8
  fi
  ensure_node_packages
  if have_runtime_binaries && have_binaries kubelet; then
    progress "node binaries cached in $NODE_BIN_DIR and $BIN_DIR"
  else
    command -v go >/dev/null || die "go (>= 1.26.8) is required to build the node binaries"
    have_binaries kubelet || {
      # The control-plane build and this one share the Go build cache; serialize them.
      exec 9>"$CACHE_ROOT/build.lock"
      flock 9
      have_binaries kubelet || build_k8s kubelet
      exec 9>&-
    }
    [[ -x $NODE_BIN_DIR/runc ]] || build_runc
    [[ -x $NODE_BIN_DIR/containerd && -x $NODE_BIN_DIR/ctr && -x $NODE_BIN_DIR/containerd-shim-runc-v2 ]] || build_containerd
  fi
  # (Outputs captured first: `cmd | grep -q` can fail on SIGPIPE under pipefail.)
  local v
  v=$("$BIN_DIR/kubelet" --version); [[ $v == *"v$K8S_VERSION"* ]] || die "kubelet is not stamped v$K8S_VERSION: $v"
  v=$("$NODE_BIN_DIR/containerd" --version); [[ $v == *"v$CONTAINERD_VERSION"* ]] || die "containerd is not v$CONTAINERD_VERSION: $v"
  v=$("$NODE_BIN_DIR/runc" --version); [[ $v == *"runc version $RUNC_VERSION"* ]] || die "runc is not $RUNC_VERSION: $v"
  exec 8>&-
  progress "node build done: kubelet in $BIN_DIR; containerd, ctr, shim, runc in $NODE_BIN_DIR"
}

# --- the KEP-5322 prototype kubelet (docs/kep-5322.md) -----------------------------
# GPU_DRA_KEP5322_KUBELET=1 (`up --with-node --kep5322-kubelet`) runs the kubelet that
# hack/build-kubelet-kep5322.sh builds from the upstream one and hack/patches/, with the
# feature gate DRAHandlePermanentDriverFailures set to GPU_DRA_KEP5322_GATE [true]
# (false: the patched binary with the gate off, which must behave as upstream). The
# choice is recorded in the run dir, so `restart-kubelet` starts the same binary.
KEP5322_GATE=DRAHandlePermanentDriverFailures

kep5322_kubelet_wanted() { [[ ${GPU_DRA_KEP5322_KUBELET:-0} == 1 ]]; }
kep5322_choice_file() { printf '%s' "$NODE_DIR/kubelet-kep5322.env"; } # node.sh sets NODE_DIR

# Builds (or finds) the prototype and records it with the gate's value; without the
# option, removes an earlier choice.
kep5322_kubelet_prepare() {
  if ! kep5322_kubelet_wanted; then
    rm -f "$(kep5322_choice_file)"
    return 0
  fi
  local gate=${GPU_DRA_KEP5322_GATE:-true} bin
  [[ $gate == true || $gate == false ]] || die "GPU_DRA_KEP5322_GATE must be true or false, not '$gate'"
  bin=$("$HACK_DIR/build-kubelet-kep5322.sh" | tail -n 1) || die "hack/build-kubelet-kep5322.sh failed"
  mkdir -p "$NODE_DIR"
  printf 'binary=%s\ngate=%s\n' "$bin" "$gate" >"$(kep5322_choice_file)"
  progress "node runs the KEP-5322 prototype kubelet ($KEP5322_GATE=$gate): $bin"
}

kep5322_choice() { # <key>: binary or gate, from the recorded choice
  local file
  file=$(kep5322_choice_file)
  [[ -f $file ]] || return 1
  sed -n "s/^$1=//p" "$file"
}

# The kubelet binary the node runs.
node_kubelet_binary() { kep5322_choice binary || printf '%s' "$BIN_DIR/kubelet"; }

# The gate's line for the kubelet config's featureGates map (nothing for upstream).
kep5322_feature_gate_yaml() {
  local gate
  gate=$(kep5322_choice gate) || return 0
  printf '  %s: %s\n' "$KEP5322_GATE" "$gate"
}
