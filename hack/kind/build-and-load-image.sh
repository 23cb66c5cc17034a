#!/usr/bin/env bash
# Builds the driver image and loads it into every node of the kind cluster, with the
# demo's busybox image (localhost/gpu-dra/busybox:1.35, which demo/*.yaml name).
#
#   hack/kind/build-and-load-image.sh                       build + load DRIVER_IMAGE
#   hack/kind/build-and-load-image.sh --refresh-base-images first rewrite the Dockerfile's
#                                                           base-image digests to their
#                                                           tags' current ones (engine build)
#   hack/kind/build-and-load-image.sh --oci-archive FILE    load an archive made by
#                                                           hack/build-image.sh instead
#
# How the driver image is built (KIND_IMAGE_BUILD):
#   engine   docker/podman build of deployments/container/Dockerfile (base images from
#            a registry, pinned by digest)
#   offline  hack/build-image.sh: no Docker, no registry (debootstrap + pip with hashes),
#            cached per hash of the driver's sources like the local cluster's image
#   auto     (default) offline when the cluster runs the offline node image
#            (create-cluster.sh chose KIND_NODE_SOURCE=offline: no registry), else engine
set -euo pipefail
# shellcheck source=hack/kind/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# shellcheck source=hack/lib/images.sh
source "$HACK_DIR/lib/images.sh"

BASE_IMAGES=$REPO_DIR/deployments/container/base-images.sh
archive=
refresh_base=false
case ${1:-} in
  --oci-archive) archive=${2:?--oci-archive needs a file}; [[ $# -eq 2 ]] || kind_die "usage: $0 --oci-archive FILE" ;;
  --refresh-base-images) refresh_base=true ;;
  "") ;;
  *) kind_die "usage: $0 [--refresh-base-images | --oci-archive FILE]" ;;
esac
KIND_IMAGE_BUILD=${KIND_IMAGE_BUILD:-auto}
case $KIND_IMAGE_BUILD in auto|engine|offline) ;;
  *) kind_die "KIND_IMAGE_BUILD must be auto, engine or offline, not '$KIND_IMAGE_BUILD'" ;;
esac

"$KIND" get clusters 2>/dev/null | has_line "$KIND_CLUSTER_NAME" ||
  kind_die "no kind cluster $KIND_CLUSTER_NAME: run make kind-up (hack/kind/create-cluster.sh) first"
mapfile -t nodes < <("$KIND" get nodes --name "$KIND_CLUSTER_NAME")

load_archive() { # <archive> <image name>
  local t0
  t0=$(date +%s)
  kind_progress "loading $2 into ${#nodes[@]} nodes ($(du -h "$1" | cut -f1))"
  "$KIND" load image-archive "$1" --name "$KIND_CLUSTER_NAME" >/dev/null
  local node
  for node in "${nodes[@]}"; do
    "$CONTAINER_TOOL" exec "$node" ctr -n k8s.io images ls -q 2>/dev/null | has_line "$2" ||
      kind_die "$2 is not in $node's containerd after kind load image-archive $1"
  done
  kind_progress "  loaded in $(( $(date +%s) - t0 ))s"
}

wait_or_timeout() { # <pid> <seconds>: true once pid has exited
  local i
  for ((i = 0; i < $2; i++)); do
    kill -0 "$1" 2>/dev/null || return 0
    sleep 1
  done
  return 1
}

# The demo's busybox, from Debian's busybox-static (hack/lib/images.sh).
load_busybox() {
  if [[ -x /bin/busybox ]] && ! ldd /bin/busybox >/dev/null 2>&1; then
    build_busybox_image
    load_archive "$IMAGES_DIR/busybox.oci.tar" "$BUSYBOX_IMAGE"
  else
    kind_progress "no static /bin/busybox (Debian: apt-get install busybox-static): $BUSYBOX_IMAGE, which demo/*.yaml run, is not loaded"
  fi
}

if [[ -n $archive ]]; then
  [[ -f $archive ]] || kind_die "no such archive: $archive"
  kind_progress "loading $archive into $KIND_CLUSTER_NAME"
  "$KIND" load image-archive "$archive" --name "$KIND_CLUSTER_NAME"
  exit 0
fi

mode=$KIND_IMAGE_BUILD
if [[ $mode == auto ]]; then
  node_image=$("$CONTAINER_TOOL" inspect --format '{{.ImageName}}' "${nodes[0]}" 2>/dev/null ||
    "$CONTAINER_TOOL" inspect --format '{{.Config.Image}}' "${nodes[0]}")
  if [[ $node_image == "$KIND_OFFLINE_IMAGE" ]]; then mode=offline; else mode=engine; fi
  kind_progress "nodes run $node_image: building the driver image the $mode way (KIND_IMAGE_BUILD)"
fi

if [[ $mode == offline ]]; then
  [[ $(normalize_image_name "$DRIVER_IMAGE_TAG") == "$DRIVER_IMAGE" ]] ||
    kind_die "KIND_IMAGE_BUILD=offline builds $DRIVER_IMAGE_TAG ($(normalize_image_name "$DRIVER_IMAGE_TAG")); DRIVER_IMAGE is $DRIVER_IMAGE (set GPU_DRA_DRIVER_IMAGE too)"
  # Cached per source hash; hack/build-image.sh (debootstrap, pip --require-hashes), whose
  # log says where it is: its last line every 30 s.
  build_driver_image &
  pid=$!
  while ! wait_or_timeout "$pid" 30; do
    kind_progress "driver image: $(tail -n 1 "$CACHE_ROOT/build-driver-image.log" 2>/dev/null | cut -c1-160)"
  done
  wait "$pid"
  load_archive "$IMAGES_DIR/driver-$(driver_source_hash).oci.tar" "$DRIVER_IMAGE"
  load_busybox
  exit 0
fi

need "$CONTAINER_TOOL"
export CONTAINER_TOOL
if $refresh_base; then
  kind_progress "refreshing the base-image digests in deployments/container/Dockerfile"
  "$BASE_IMAGES" refresh
else
  # The pins stay as committed; say whether their tags have moved since.
  "$BASE_IMAGES" check ||
    kind_progress "building from the pinned digests anyway; --refresh-base-images updates them"
fi
# Base images by digest, not by their mutable tags: the Dockerfile's pins, or
# PYTHON_IMAGE / GOLANG_IMAGE (a tag is resolved to its digest here), so that both
# Python stages get the same image and the log says which.
by_digest() { # <image>
  local image=$1
  if [[ $image != *@sha256:* ]]; then
    kind_progress "resolving $image to a digest" >&2
    "$CONTAINER_TOOL" pull --quiet "$image" >/dev/null
    image=$("$CONTAINER_TOOL" image inspect --format '{{index .RepoDigests 0}}' "$image") ||
      kind_die "cannot read the digest of $image"
  fi
  printf '%s' "$image"
}
python_image=${PYTHON_IMAGE:-$("$BASE_IMAGES" pinned PYTHON_IMAGE)}
golang_image=${GOLANG_IMAGE:-$("$BASE_IMAGES" pinned GOLANG_IMAGE)}
python_image=$(by_digest "$python_image")
golang_image=$(by_digest "$golang_image")
kind_progress "building $DRIVER_IMAGE with $CONTAINER_TOOL from $python_image and $golang_image"
"$CONTAINER_TOOL" build -f "$REPO_DIR/deployments/container/Dockerfile" \
  --build-arg "PYTHON_IMAGE=$python_image" --build-arg "GOLANG_IMAGE=$golang_image" \
  -t "$DRIVER_IMAGE" "$REPO_DIR"

# `kind load docker-image` does not work with podman or with every containerd config,
# so stream the image into each node's containerd directly.
kind_progress "loading $DRIVER_IMAGE into the nodes of $KIND_CLUSTER_NAME"
for node in "${nodes[@]}"; do
  "$CONTAINER_TOOL" save "$DRIVER_IMAGE" |
    "$CONTAINER_TOOL" exec -i "$node" ctr --namespace=k8s.io images import --all-platforms -
  kind_progress "  $node: loaded"
done
load_busybox
