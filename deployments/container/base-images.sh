#!/usr/bin/env bash
# The base images of deployments/container/Dockerfile, pinned by digest:
# `ARG PYTHON_IMAGE=<name>:<tag>@sha256:<digest>` (and GOLANG_IMAGE). A tag moves with
# every security rebuild; the digest does not, so a commit always builds from the same
# bases. This script shows the pins, checks them against the tags and refreshes them.
#
#   deployments/container/base-images.sh list            the pinned references (fails if one is a bare tag)
#   deployments/container/base-images.sh pinned ARG      one of them (PYTHON_IMAGE, GOLANG_IMAGE)
#   deployments/container/base-images.sh check           each tag's current digest against its pin;
#                                                        exit 1 if a tag has moved
#   deployments/container/base-images.sh refresh         rewrite the pins to the tags' current digests
#
# check and refresh pull each tag with docker or podman (CONTAINER_TOOL) and read its
# digest from the image's RepoDigests (the digest the tag was pulled by: the multi-
# platform index's under Docker). Review and commit the rewritten Dockerfile; the next
# build verifies the content it pulls against the new digest.
# DOCKERFILE=<path> works on another copy.
set -euo pipefail

DOCKERFILE=${DOCKERFILE:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/Dockerfile}
PINNED_ARGS=(PYTHON_IMAGE GOLANG_IMAGE)
PINNED_RE='^[^@[:space:]]+:[^@/:[:space:]]+@sha256:[0-9a-f]{64}$'

die() { printf 'base-images: %s\n' "$*" >&2; exit 1; }

[[ -f $DOCKERFILE ]] || die "no Dockerfile at $DOCKERFILE"

pinned() { # <ARG>: its default in the Dockerfile, checked to be <name>:<tag>@sha256:<digest>
  local value
  value=$(sed -n "s/^ARG $1=//p" "$DOCKERFILE")
  [[ -n $value ]] || die "$DOCKERFILE has no 'ARG $1=...'"
  [[ $value =~ $PINNED_RE ]] ||
    die "$DOCKERFILE: ARG $1=$value is not pinned as <name>:<tag>@sha256:<digest>; run $0 refresh"
  printf '%s\n' "$value"
}

container_tool() {
  if [[ -n ${CONTAINER_TOOL:-} ]]; then printf '%s\n' "$CONTAINER_TOOL"
  elif command -v docker >/dev/null; then echo docker
  elif command -v podman >/dev/null; then echo podman
  else die "check and refresh need docker or podman (or CONTAINER_TOOL)"
  fi
}

current_digest() { # <name>:<tag>: the digest the tag resolves to now
  local tool=$1 ref=$2 repo digests digest
  repo=${ref%:*}
  "$tool" pull --quiet "$ref" >/dev/null || die "cannot pull $ref"
  digests=$("$tool" image inspect --format '{{range .RepoDigests}}{{println .}}{{end}}' "$ref") ||
    die "cannot inspect $ref"
  # RepoDigests name the repository as pulled (python@..., docker.io/library/python@...).
  digest=$(printf '%s\n' "$digests" | grep -E "(^|/)${repo##*/}@sha256:" | head -n 1)
  [[ -n $digest ]] || die "no digest of $ref in its RepoDigests: $digests"
  printf '%s\n' "${digest#*@}"
}

case ${1:-} in
  list)
    for arg in "${PINNED_ARGS[@]}"; do
      ref=$(pinned "$arg")
      printf '%s=%s\n' "$arg" "$ref"
    done
    ;;
  pinned)
    pinned "${2:?usage: $0 pinned PYTHON_IMAGE|GOLANG_IMAGE}"
    ;;
  check | refresh)
    tool=$(container_tool)
    moved=0
    for arg in "${PINNED_ARGS[@]}"; do
      if [[ $1 == refresh ]]; then
        # A bare tag is what refresh repairs.
        old=$(sed -n "s/^ARG $arg=//p" "$DOCKERFILE")
        [[ -n $old ]] || die "$DOCKERFILE has no 'ARG $arg=...'"
      else
        old=$(pinned "$arg")
      fi
      tag=${old%@*}
      new="$tag@$(current_digest "$tool" "$tag")"
      if [[ $new == "$old" ]]; then
        printf '%s %s: pinned digest is current\n' "$arg" "$tag"
      elif [[ $1 == check ]]; then
        printf '%s %s: pinned %s, the tag is now at %s: run %s refresh\n' \
          "$arg" "$tag" "${old#*@}" "${new#*@}" "$0"
        moved=1
      else
        sed -i "s|^ARG $arg=.*|ARG $arg=$new|" "$DOCKERFILE"
        printf '%s: %s -> %s\n' "$arg" "$old" "$new"
      fi
    done
    exit "$moved"
    ;;
  *)
    sed -n '2,18p' "${BASH_SOURCE[0]}"
    [[ ${1:-} == -h || ${1:-} == --help ]] || exit 2
    ;;
esac
