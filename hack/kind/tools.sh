#!/usr/bin/env bash
# Installs what the kind scripts need and prints where it is. Nothing is pulled from a
# container registry:
#   kind    built from the Go module proxy (`go install sigs.k8s.io/kind@v$KIND_VERSION`,
#           hack/versions.env) into the cache, keyed by its version
#   podman  Debian's package (apt-get), with runc as its OCI runtime, only when no
#           working Docker engine is there (CONTAINER_TOOL overrides the choice)
#
#   hack/kind/tools.sh ensure    install what is missing
#   hack/kind/tools.sh kind      path of the pinned kind binary (empty if not built)
#
# Podman runs with a configuration of the project's own (CONTAINERS_CONF, written to
# the cache): cgroup_manager=cgroupfs and events_logger=file (no systemd on a host like
# this one), runtime runc (crun refuses a cgroup v1 "hybrid" host), no default ulimits
# (raising RLIMIT_NOFILE needs CAP_SYS_RESOURCE). The host's own containers.conf is not
# touched.
set -euo pipefail
# shellcheck source=hack/kind/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

KIND_BIN=$CACHE_ROOT/bin/kind-v$KIND_VERSION/kind
PODMAN_APT_PACKAGES=(podman runc netavark aardvark-dns)

apt_missing() {
  local p
  for p in "$@"; do
    [[ $(dpkg-query -W -f='${Status}' "$p" 2>/dev/null) == *"install ok installed"* ]] || printf '%s ' "$p"
  done
}

ensure_podman() {
  local missing
  missing=$(apt_missing "${PODMAN_APT_PACKAGES[@]}")
  if [[ -n $missing ]]; then
    command -v apt-get >/dev/null || kind_die "podman is needed and there is no apt-get to install: $missing"
    ((EUID == 0)) || kind_die "installing $missing needs root (apt-get)"
    kind_progress "apt-get install $missing(Debian's Podman; ~10-60 s)"
    mkdir -p "$CACHE_ROOT"
    # shellcheck disable=SC2086  # word splitting wanted
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing; } \
      >"$CACHE_ROOT/apt-podman.log" 2>&1 ||
      { tail -n 20 "$CACHE_ROOT/apt-podman.log" >&2; kind_die "apt-get install failed: $missing (log: $CACHE_ROOT/apt-podman.log)"; }
  fi
  # kind mounts /lib/modules read-only into every node; Podman (unlike Docker) fails
  # when the source is missing, as on a kernel with every module built in.
  [[ -d /lib/modules ]] || { kind_progress "creating an empty /lib/modules (kind mounts it into the nodes)"; mkdir -p /lib/modules; }
  write_podman_conf
}

write_podman_conf() {
  local runc
  runc=$(command -v runc) || kind_die "runc not found (apt-get install runc)"
  mkdir -p "$(dirname "$PODMAN_CONF")"
  cat >"$PODMAN_CONF.tmp" <<EOF
# Written by hack/kind/tools.sh; used through CONTAINERS_CONF by the hack/kind scripts.
[containers]
default_ulimits = []

[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
runtime = "runc"

[engine.runtimes]
runc = ["$runc"]

[network]
network_backend = "netavark"
EOF
  mv "$PODMAN_CONF.tmp" "$PODMAN_CONF"
}

ensure_kind() {
  if [[ -x $KIND_BIN ]] && [[ $("$KIND_BIN" version) == "kind v$KIND_VERSION "* ]]; then return 0; fi
  command -v go >/dev/null || kind_die "go (>= 1.26) is needed to build kind v$KIND_VERSION"
  kind_progress "building kind v$KIND_VERSION from the Go module proxy into $(dirname "$KIND_BIN") (2 cores: ~2-4 min cold)"
  mkdir -p "$(dirname "$KIND_BIN").partial"
  GOTOOLCHAIN=local CGO_ENABLED=0 GOBIN="$(dirname "$KIND_BIN").partial" \
    go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kind@v$KIND_VERSION" \
    >"$CACHE_ROOT/build-kind.log" 2>&1 ||
    { tail -n 20 "$CACHE_ROOT/build-kind.log" >&2; kind_die "go install sigs.k8s.io/kind@v$KIND_VERSION failed (log: $CACHE_ROOT/build-kind.log)"; }
  mkdir -p "$(dirname "$KIND_BIN")"
  mv "$(dirname "$KIND_BIN").partial/kind" "$KIND_BIN"
  rmdir "$(dirname "$KIND_BIN").partial"
  kind_progress "$("$KIND_BIN" version)"
}

case ${1:-} in
  ensure)
    [[ $# -eq 1 ]] || kind_die "usage: $0 ensure|kind"
    if [[ $CONTAINER_TOOL == podman ]]; then ensure_podman; fi
    command -v "$CONTAINER_TOOL" >/dev/null || kind_die "$CONTAINER_TOOL not found"
    ensure_kind
    kind_progress "tools: $("$KIND_BIN" version | cut -d' ' -f1-2), $("$CONTAINER_TOOL" --version)"
    ;;
  kind)
    [[ -x $KIND_BIN ]] && printf '%s\n' "$KIND_BIN"
    ;;
  *) kind_die "usage: $0 ensure|kind" ;;
esac
