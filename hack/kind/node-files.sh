# shellcheck shell=bash
# The node root's configuration, for hack/kind/build-node-image.sh. Sourced, never
# executed. The steps follow kind's base image (images/base/Dockerfile of the kind
# version pinned in hack/versions.env); the files themselves are copied from that kind
# module at build time, never kept in this repository.

# install_node_files <root> <kind's images/base/files>
install_node_files() {
  local root=$1 files=$2
  cp -r --no-preserve=mode,ownership "$files/." "$root/"
  chmod 0755 "$root/usr/local/bin/entrypoint" "$root/usr/local/bin/clean-install" "$root"/kind/bin/*.sh
  chmod 0755 "$root/kind" "$root/kind/bin"
  # systemd trimmed as kind's base does: no tmpfiles at boot, nothing wanted by default.
  rm -f "$root/lib/systemd/system/sysinit.target.wants/systemd-tmpfiles-setup.service" \
    "$root"/lib/systemd/system/multi-user.target.wants/* \
    "$root"/etc/systemd/system/*.wants/* \
    "$root"/lib/systemd/system/local-fs.target.wants/* \
    "$root"/lib/systemd/system/sockets.target.wants/*udev* \
    "$root"/lib/systemd/system/sockets.target.wants/*initctl* \
    "$root"/lib/systemd/system/basic.target.wants/*
  printf 'ReadKMsg=no\n' >>"$root/etc/systemd/journald.conf"
  ln -sf /usr/lib/systemd/systemd "$root/usr/sbin/init"
  mkdir -p "$root/etc/kubernetes/manifests" "$root/opt/cni" "$root/etc/cni/net.d"
  # Debian's CNI plugins (containernetworking-plugins) where containerd looks for them.
  ln -sfn /usr/lib/cni "$root/opt/cni/bin"
  # containerd: the project's pause image as the sandbox image (kubeadm's pause is never
  # pulled), and pods' oom_score_adj clamped to containerd's own: lowering it needs
  # CAP_SYS_RESOURCE, which a host like this one does not grant even to privileged
  # containers (runc would fail every container that asks for less).
  sed -i -e "s|^\(\s*sandbox_image\s*=\).*|\1 \"$PAUSE_IMAGE\"|" \
    -e 's|^\(\s*restrict_oom_score_adj\s*=\).*|\1 true|' "$root/etc/containerd/config.toml"
  grep -q "sandbox_image = \"$PAUSE_IMAGE\"" "$root/etc/containerd/config.toml" ||
    kind_die "kind's containerd config has no sandbox_image line to point at $PAUSE_IMAGE"
  write_image_import "$root"
  env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin chroot "$root" /bin/sh -eu -c '
    systemctl enable kubelet.service containerd.service undo-mount-hacks.service >/dev/null 2>&1
    systemctl mask systemd-binfmt.service >/dev/null 2>&1'
  [[ -L $root/etc/systemd/system/multi-user.target.wants/containerd.service ]] ||
    kind_die "systemctl enable containerd.service did nothing in the node root"
}

# The component images in /kind/images are imported into containerd right before the
# kubelet first starts (after kind has configured and restarted containerd), pinned so
# that the kubelet's image GC never removes them: nothing can be pulled again.
write_image_import() {
  local root=$1
  cat >"$root/kind/bin/gpu-dra-import-images.sh" <<'SH'
#!/bin/sh
# Imports /kind/images/*.tar into containerd (namespace k8s.io) unless present.
set -eu
i=0
until ctr version >/dev/null 2>&1; do
  i=$((i + 1)); [ "$i" -le 120 ] || { echo "containerd not answering after 60 s" >&2; exit 1; }
  sleep 0.5
done
present=$(ctr -n k8s.io images ls -q)
for archive in /kind/images/*.tar; do
  name=$(cat "${archive%.tar}.name")
  if printf '%s\n' "$present" | grep -qxF "$name"; then continue; fi
  echo "importing $name"
  ctr -n k8s.io images import --label io.cri-containerd.pinned=pinned "$archive" >/dev/null
done
SH
  chmod 0755 "$root/kind/bin/gpu-dra-import-images.sh"
  cat >"$root/etc/systemd/system/kubelet.service.d/20-gpu-dra-images.conf" <<'EOF'
# gpu-dra-driver's offline node image: component images imported before the kubelet starts.
[Service]
TimeoutStartSec=600
ExecStartPre=/kind/bin/gpu-dra-import-images.sh
EOF
}

# containerd's default OCI spec as kind's base writes it: with kind's createContainer
# hook and without rlimits (/etc/containerd/cri-base.json, base_runtime_spec).
write_cri_base_json() {
  local root=$1
  "$NODE_BIN_DIR/ctr" oci spec | python3 -c '
import json, sys
spec = json.load(sys.stdin)
spec.setdefault("hooks", {}).setdefault("createContainer", []).append({"path": "/kind/bin/mount-product-files.sh"})
spec["process"].pop("rlimits", None)
json.dump(spec, sys.stdout, indent=2)' >"$root/etc/containerd/cri-base.json"
}
