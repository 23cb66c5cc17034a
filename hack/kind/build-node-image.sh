#!/usr/bin/env bash
# Builds a kind node image with no registry and no `kind build node-image` (which runs
# Docker and downloads kindest/base): Debian bookworm from debootstrap, kind's node
# files (entrypoint, systemd units, containerd config) taken at build time from the
# kind module in the Go module cache, and the project's pinned binaries (hack/versions.env:
# Kubernetes, containerd, runc; hack/local-cluster.sh and hack/lib/build.sh build them
# into the cache). The control-plane components, etcd, kube-proxy and pause become
# images under local names (KIND_COMPONENT_REPO, kubeadm's imageRepository) that each
# node imports into its containerd before its kubelet first starts.
#
#   hack/kind/build-node-image.sh            build KIND_OFFLINE_IMAGE (if its inputs
#                                            changed) and load it into CONTAINER_TOOL
#   hack/kind/build-node-image.sh --base     only the cached Debian root (debootstrap)
#   hack/kind/build-node-image.sh --name     print the image name and exit
#
# The image has no default CNI manifest (kindnetd is not on the Go module proxy) and no
# storage manifest: create-cluster.sh sets disableDefaultCNI and configures Debian's
# bridge plugin on each node itself (hack/kind/cni.sh). Needs root (debootstrap, chroot).
set -euo pipefail
# shellcheck source=hack/kind/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# shellcheck source=hack/lib/build.sh
source "$HACK_DIR/lib/build.sh"
# shellcheck source=hack/lib/node-build.sh
source "$HACK_DIR/lib/node-build.sh"
# shellcheck source=hack/lib/images.sh
source "$HACK_DIR/lib/images.sh"

NODE_CACHE=$CACHE_ROOT/kind
SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
KEYRING=${DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}
# kind's base image package list (images/base/Dockerfile) without what only rootless,
# NFS or iSCSI use, plus Debian's CNI plugins (bridge, host-local, loopback, portmap).
NODE_PACKAGES=systemd,conntrack,iptables,nftables,iproute2,ethtool,util-linux,mount,kmod,libseccomp2,pigz,e2fsprogs,bash,ca-certificates,curl,jq,procps,containernetworking-plugins
K8S_NODE_BINARIES=(kubeadm kubelet kubectl)
K8S_IMAGE_BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kube-proxy)
KIND_MODULE_DIR=

case ${1:-} in
  --name) printf '%s\n' "$KIND_OFFLINE_IMAGE"; exit 0 ;;
  --base|"") ;;
  *) kind_die "usage: $0 [--base|--name]" ;;
esac
((EUID == 0)) || kind_die "must run as root (debootstrap and chroot)"

# --- the Debian root (cached by suite, packages and mirror) ---------------------------
base_key=$(printf '%s|%s|%s' "$SUITE" "$NODE_PACKAGES" "$MIRROR" | sha256sum | cut -c1-12)
BASE_DIR=$NODE_CACHE/node-base-$base_key
ensure_base() {
  [[ -f $BASE_DIR/.complete ]] && { kind_progress "node base cached in $BASE_DIR"; return 0; }
  command -v debootstrap >/dev/null || ensure_node_packages
  [[ -s $KEYRING ]] || kind_die "no keyring $KEYRING: apt-get install -y debian-archive-keyring"
  rm -rf "$BASE_DIR.new" && mkdir -p "$BASE_DIR.new"
  kind_progress "debootstrap --variant=minbase $SUITE + $(tr ',' '\n' <<<"$NODE_PACKAGES" | wc -l) packages into $BASE_DIR (~140 packages; 2 cores: 3-6 min)"
  debootstrap --variant=minbase --keyring="$KEYRING" --force-check-gpg --include="$NODE_PACKAGES" \
    "$SUITE" "$BASE_DIR.new/rootfs" "$MIRROR" >"$BASE_DIR.new/debootstrap.log" 2>&1 &
  local pid=$! t0
  t0=$(date +%s)
  while kill -0 "$pid" 2>/dev/null; do
    sleep 20
    kill -0 "$pid" 2>/dev/null &&
      kind_progress "debootstrap: $(( $(date +%s) - t0 ))s, $(grep -c '^I: \(Retrieving\|Validating\|Unpacking\|Configuring\) ' "$BASE_DIR.new/debootstrap.log" || true) of ~560 steps (retrieve, validate, unpack, configure)"
  done
  wait "$pid" || { tail -n 30 "$BASE_DIR.new/debootstrap.log" >&2; kind_die "debootstrap failed (log: $BASE_DIR.new/debootstrap.log)"; }
  grep -q '^I: Valid Release signature' "$BASE_DIR.new/debootstrap.log" ||
    kind_die "debootstrap reported no valid Release signature ($BASE_DIR.new/debootstrap.log)"
  env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin chroot "$BASE_DIR.new/rootfs" /bin/sh -eu -c '
    apt-get clean
    rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/*.log /var/log/apt/*'
  touch "$BASE_DIR.new/.complete"
  rm -rf "$BASE_DIR" && mv "$BASE_DIR.new" "$BASE_DIR"
  kind_progress "node base ready: $(du -sh "$BASE_DIR/rootfs" | cut -f1)"
}

# --- the pinned binaries ---------------------------------------------------------------
ensure_binaries() {
  local missing=() b
  for b in kubeadm kube-proxy; do have_binaries "$b" || missing+=("$b"); done
  if ((${#missing[@]})); then
    # One Go build at a time per cache: the same lock as hack/local-cluster.sh build.
    exec 9>"$CACHE_ROOT/build.lock"
    flock -n 9 || { kind_progress "another build holds $CACHE_ROOT/build.lock; waiting for it"; flock 9; }
    missing=()
    for b in kubeadm kube-proxy; do have_binaries "$b" || missing+=("$b"); done
    ((${#missing[@]} == 0)) || build_k8s "${missing[@]}"
    exec 9>&-
  fi
  # The rest of the pinned binaries: control plane, kubelet, containerd, runc (the build
  # takes the cache's build lock even when nothing is missing: only when something is).
  if ! have_binaries "${K8S_NODE_BINARIES[@]}" "${K8S_IMAGE_BINARIES[@]}" etcd || ! have_runtime_binaries; then
    GPU_DRA_WITH_NODE=1 "$HACK_DIR/local-cluster.sh" build
  fi
  for b in "${K8S_NODE_BINARIES[@]}" "${K8S_IMAGE_BINARIES[@]}" etcd; do
    have_binaries "$b" || kind_die "$BIN_DIR/$b missing after the build"
  done
  build_pause_image
  KIND_MODULE_DIR=$(cd / && GOFLAGS=-mod=mod go mod download -json "sigs.k8s.io/kind@v$KIND_VERSION" |
    sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
  [[ -d $KIND_MODULE_DIR/images/base/files ]] ||
    kind_die "kind's node files not found in the Go module cache (sigs.k8s.io/kind@v$KIND_VERSION)"
}

# What the image is made of; the engine's image carries it as a label.
image_key() {
  {
    printf '%s\n' "$base_key" "$K8S_VERSION" "$ETCD_VERSION" "$CONTAINERD_VERSION" "$RUNC_VERSION" "$KIND_VERSION"
    cat "${BASH_SOURCE[0]}" "$KIND_DIR/node-files.sh" # contents only: not where the checkout is
  } | sha256sum | cut -c1-16
}

engine_has_image() {
  local label
  label=$("$CONTAINER_TOOL" image inspect --format '{{index .Config.Labels "gpu-dra.node-image-key"}}' \
    "$KIND_OFFLINE_IMAGE" 2>/dev/null) || return 1
  [[ $label == "$1" ]]
}

# component_image <name> <rootfs dir> <binary>...: an image holding the binaries in
# /usr/local/bin, archived as /kind/images/<name>.tar in the node root.
component_image() {
  local name=$1 dir=$2; shift 2
  mkdir -p "$dir/usr/local/bin"
  local b
  for b in "$@"; do install -m 0755 "$BIN_DIR/$b" "$dir/usr/local/bin/$b"; done
  oci_archive "$dir" "$KIND_COMPONENT_REPO/$name" "$ROOT/kind/images/${name%%:*}.tar"
  printf '%s\n' "$KIND_COMPONENT_REPO/$name" >"$ROOT/kind/images/${name%%:*}.name"
}

# kube-proxy in nftables mode runs `nft`: the binary and its libraries from the base.
kube_proxy_image() {
  local dir=$WORK/kube-proxy lib
  mkdir -p "$dir/usr/sbin"
  cp -L "$BASE_DIR/rootfs/usr/sbin/nft" "$dir/usr/sbin/nft"
  for lib in $(chroot "$BASE_DIR/rootfs" ldd /usr/sbin/nft | grep -o '/[^ ]*'); do
    mkdir -p "$dir$(dirname "$lib")"
    cp -L "$BASE_DIR/rootfs$lib" "$dir$lib"
  done
  component_image "kube-proxy:v$K8S_VERSION" "$dir" kube-proxy
}

assemble() {
  ROOT=$WORK/rootfs
  kind_progress "copying the node base"
  cp -a "$BASE_DIR/rootfs" "$ROOT"
  mkdir -p "$ROOT/kind/images"
  kind_progress "node files: kind v$KIND_VERSION's from $KIND_MODULE_DIR/images/base/files, the project's pinned binaries"
  # shellcheck source=hack/kind/node-files.sh
  source "$KIND_DIR/node-files.sh"
  install_node_files "$ROOT" "$KIND_MODULE_DIR/images/base/files"
  local b
  for b in "${K8S_NODE_BINARIES[@]}"; do install -m 0755 "$BIN_DIR/$b" "$ROOT/usr/bin/$b"; done
  for b in containerd containerd-shim-runc-v2 ctr; do install -m 0755 "$NODE_BIN_DIR/$b" "$ROOT/usr/local/bin/$b"; done
  install -m 0755 "$NODE_BIN_DIR/runc" "$ROOT/usr/local/sbin/runc"
  write_cri_base_json "$ROOT"
  kind_progress "component images under $KIND_COMPONENT_REPO (uncompressed, one layer each)"
  local c
  for c in kube-apiserver kube-controller-manager kube-scheduler; do
    component_image "$c:v$K8S_VERSION" "$WORK/$c" "$c"
  done
  component_image "etcd:$ETCD_VERSION" "$WORK/etcd" etcd
  kube_proxy_image
  cp "$IMAGES_DIR/pause.oci.tar" "$ROOT/kind/images/pause.tar"
  printf '%s\n' "$PAUSE_IMAGE" >"$ROOT/kind/images/pause.name"
  printf 'v%s\n' "$K8S_VERSION" >"$ROOT/kind/version"
}

load_into_engine() {
  local key=$1 size old
  old=$("$CONTAINER_TOOL" image inspect --format '{{.Id}}' "$KIND_OFFLINE_IMAGE" 2>/dev/null || true)
  size=$(du -sm --exclude=./proc "$ROOT" | cut -f1)
  kind_progress "$CONTAINER_TOOL import: ${size} MiB root as $KIND_OFFLINE_IMAGE (2 cores: ~1 min per GiB)"
  tar -C "$ROOT" --numeric-owner --xattrs --exclude=./dev/'*' --exclude=./proc/'*' --exclude=./sys/'*' \
    --exclude=./run/'*' --exclude=./tmp/'*' -cf - . |
    "$CONTAINER_TOOL" import \
      --change 'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]' \
      --change 'ENV container=docker' \
      --change 'STOPSIGNAL SIGRTMIN+3' \
      --change "LABEL gpu-dra.node-image-key=$key" \
      - "$KIND_OFFLINE_IMAGE" >/dev/null
  engine_has_image "$key" || kind_die "$KIND_OFFLINE_IMAGE is not in $CONTAINER_TOOL after the import"
  # The image this one replaces (now untagged), unless a node still runs it.
  if [[ -n $old ]]; then "$CONTAINER_TOOL" image rm "$old" >/dev/null 2>&1 || true; fi
}

mkdir -p "$NODE_CACHE"
exec 7>"$NODE_CACHE/node-image.lock"
flock -n 7 || { kind_progress "another node image build holds $NODE_CACHE/node-image.lock; waiting"; flock 7; }
ensure_base
[[ ${1:-} == --base ]] && exit 0
ensure_binaries
key=$(image_key)
if engine_has_image "$key"; then
  kind_progress "$KIND_OFFLINE_IMAGE is up to date in $CONTAINER_TOOL (key $key)"
  exit 0
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-dra-kind-node.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
t0=$(date +%s)
assemble
load_into_engine "$key"
kind_progress "node image $KIND_OFFLINE_IMAGE ready in $(( $(date +%s) - t0 ))s (key $key)"
