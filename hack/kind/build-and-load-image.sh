#!/usr/bin/env bash
# Builds the driver image with Docker/Podman (deployments/container/Dockerfile) and
# loads it into every node of the kind cluster.
#
#   hack/kind/build-and-load-image.sh                       build + load DRIVER_IMAGE
#   hack/kind/build-and-load-image.sh --refresh-base-images first rewrite the Dockerfile's
#                                                           base-image digests to their
#                                                           tags' current ones
#   hack/kind/build-and-load-image.sh --oci-archive FILE    load an archive made by
#                                                           hack/build-image.sh instead
set -euo pipefail
# shellcheck source=hack/kind/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

BASE_IMAGES=$REPO_DIR/deployments/container/base-images.sh
archive=
refresh_base=false
case ${1:-} in
  --oci-archive) archive=${2:?--oci-archive needs a file} ;;
  --refresh-base-images) refresh_base=true ;;
  "") ;;
  *) kind_die "usage: $0 [--refresh-base-images | --oci-archive FILE]" ;;
esac

need kind
kind get clusters 2>/dev/null | grep -qx "$KIND_CLUSTER_NAME" ||
  kind_die "no kind cluster $KIND_CLUSTER_NAME: run hack/kind/create-cluster.sh first"

if [[ -n $archive ]]; then
  [[ -f $archive ]] || kind_die "no such archive: $archive"
  kind_progress "loading $archive into $KIND_CLUSTER_NAME"
  kind load image-archive "$archive" --name "$KIND_CLUSTER_NAME"
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
for node in $(kind get nodes --name "$KIND_CLUSTER_NAME"); do
  "$CONTAINER_TOOL" save "$DRIVER_IMAGE" |
    "$CONTAINER_TOOL" exec -i "$node" ctr --namespace=k8s.io images import --all-platforms -
  kind_progress "  $node: loaded"
done
