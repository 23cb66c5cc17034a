# shellcheck shell=bash
# Container images for the real node, without Docker or a registry:
#   pause    a static binary from our own C source (below)      $PAUSE_IMAGE
#   busybox  Debian's busybox-static                             $BUSYBOX_IMAGE
#   driver   hack/build-image.sh (Debian python + the package)  $DRIVER_IMAGE_TAG, also
#            tagged src-<hash of the sources> (driver_image_tag): cached per hash
# Each is an OCI archive cached under $CACHE_ROOT/images and imported with
# `ctr -n k8s.io images import`. Sourced by hack/lib/node.sh, never executed.

IMAGES_DIR=$CACHE_ROOT/images
PAUSE_IMAGE=localhost/gpu-dra/pause:1.0
BUSYBOX_IMAGE=localhost/gpu-dra/busybox:1.35
# The chart's values-mock.yaml names gpu-dra-driver:dev (docker.io/library/ once
# normalized by the CRI).
DRIVER_IMAGE_TAG=${GPU_DRA_DRIVER_IMAGE:-gpu-dra-driver:dev}

# oci_archive <rootfs dir> <full image name> <output .tar> [entrypoint...]
# One uncompressed layer; an OCI image layout with the containerd name annotation.
oci_archive() {
  python3 - "$@" <<'PY'
import hashlib, io, json, os, sys, tarfile

rootfs, name, output, *entrypoint = sys.argv[1:]

def digest(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()

layer_buf = io.BytesIO()
with tarfile.open(fileobj=layer_buf, mode="w", format=tarfile.PAX_FORMAT) as layer:
    for dirpath, dirnames, filenames in os.walk(rootfs):
        dirnames.sort()
        for entry in sorted(dirnames) + sorted(filenames):
            path = os.path.join(dirpath, entry)
            info = layer.gettarinfo(path, arcname=os.path.relpath(path, rootfs))
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            if info.isreg():
                with open(path, "rb") as fh:
                    layer.addfile(info, fh)
            else:
                layer.addfile(info)
layer_bytes = layer_buf.getvalue()

image_config = {
    "architecture": "amd64",
    "os": "linux",
    "config": {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"]},
    "rootfs": {"type": "layers", "diff_ids": [digest(layer_bytes)]},
}
if entrypoint:
    image_config["config"]["Entrypoint"] = entrypoint
else:
    image_config["config"]["Cmd"] = ["sh"]
config_bytes = json.dumps(image_config, sort_keys=True).encode()
manifest_bytes = json.dumps({
    "schemaVersion": 2,
    "mediaType": "application/vnd.oci.image.manifest.v1+json",
    "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
               "digest": digest(config_bytes), "size": len(config_bytes)},
    "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": digest(layer_bytes), "size": len(layer_bytes)}],
}, sort_keys=True).encode()
index_bytes = json.dumps({
    "schemaVersion": 2,
    "mediaType": "application/vnd.oci.image.index.v1+json",
    "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": digest(manifest_bytes), "size": len(manifest_bytes),
        "platform": {"architecture": "amd64", "os": "linux"},
        "annotations": {"io.containerd.image.name": name,
                        "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1]},
    }],
}, sort_keys=True).encode()

tmp = output + ".partial"
with tarfile.open(tmp, "w") as out:
    def put(arcname, data):
        info = tarfile.TarInfo(arcname)
        info.size = len(data)
        out.addfile(info, io.BytesIO(data))
    put("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
    put("index.json", index_bytes)
    for blob in (layer_bytes, config_bytes, manifest_bytes):
        put("blobs/sha256/" + digest(blob).split(":")[1], blob)
os.replace(tmp, output)
PY
}

build_pause_image() {
  local out=$IMAGES_DIR/pause.oci.tar work
  [[ -f $out ]] && return 0
  progress "building the pause image ($PAUSE_IMAGE) from our own C source"
  work=$(mktemp -d)
  mkdir -p "$work/rootfs"
  # Sleeps until SIGINT/SIGTERM (exit 0); reaps orphans as the pod's PID 1 would.
  cat >"$work/pause.c" <<'C'
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_term(int sig) { (void)sig; _exit(0); }
static void on_child(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction term = {0}, child = {0};
  term.sa_handler = on_term;
  child.sa_handler = on_child;
  child.sa_flags = SA_NOCLDSTOP | SA_RESTART;
  sigaction(SIGINT, &term, NULL);
  sigaction(SIGTERM, &term, NULL);
  sigaction(SIGCHLD, &child, NULL);
  for (;;) pause();
}
C
  gcc -static -Os -s -o "$work/rootfs/pause" "$work/pause.c" || die "compiling pause.c failed (gcc, libc6-dev)"
  mkdir -p "$IMAGES_DIR"
  oci_archive "$work/rootfs" "$PAUSE_IMAGE" "$out" /pause
  rm -rf "$work"
}

build_busybox_image() {
  local out=$IMAGES_DIR/busybox.oci.tar work
  [[ -f $out ]] && return 0
  [[ -x /bin/busybox ]] || die "/bin/busybox missing: apt-get install busybox-static"
  ldd /bin/busybox >/dev/null 2>&1 && die "/bin/busybox is not static: apt-get install busybox-static"
  progress "building the busybox image ($BUSYBOX_IMAGE) from Debian's busybox-static"
  work=$(mktemp -d)
  mkdir -p "$work/rootfs/bin" "$work/rootfs/tmp" "$work/rootfs/etc"
  cp /bin/busybox "$work/rootfs/bin/busybox"
  local applet
  for applet in $(/bin/busybox --list); do
    [[ $applet == busybox ]] || ln -sf busybox "$work/rootfs/bin/$applet"
  done
  printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' >"$work/rootfs/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' >"$work/rootfs/etc/group"
  chmod 1777 "$work/rootfs/tmp"
  mkdir -p "$IMAGES_DIR"
  oci_archive "$work/rootfs" "$BUSYBOX_IMAGE" "$out"
  rm -rf "$work"
}

# Hash of everything that goes into the driver image, so a changed tree rebuilds it.
driver_source_hash() {
  local repo=$HACK_DIR/..
  (cd "$repo" && find driver pyproject.toml requirements.lock hack/build-image.sh \
    hack/build-nvidia-tools.sh hack/versions.env cmd/gpu-dra-cdi-common -type f \
    ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
}

# The tag every driver image is also imported under: changes with the sources, so a
# `helm upgrade --set image.tag=$(hack/local-cluster.sh driver-image-tag)` restarts the
# plugin on the image built from this tree, never on a stale one.
driver_image_tag() { printf 'src-%s' "$(driver_source_hash)"; }

# The tag `up` imported the driver image under, recorded in the run dir: the sources may
# change while a cluster runs (or while `up` builds), and a later `helm upgrade` must name
# the image that is on the node, not one of a newer tree. Falls back to this tree's tag.
IMPORTED_TAG_FILE=driver-image-tag
imported_driver_image_tag() {
  if [[ -f $RUN_DIR/$IMPORTED_TAG_FILE ]]; then cat "$RUN_DIR/$IMPORTED_TAG_FILE"; else driver_image_tag; fi
}

build_driver_image() {
  local hash out
  hash=$(driver_source_hash)
  out=$IMAGES_DIR/driver-$hash.oci.tar
  DRIVER_IMAGE_ARCHIVE=$out
  DRIVER_IMAGE_SRC_TAG=src-$hash
  [[ -f $out ]] && { progress "driver image for source $hash cached"; return 0; }
  progress "building the driver image $DRIVER_IMAGE_TAG for source $hash with hack/build-image.sh (first time: debootstrap, a few minutes)"
  mkdir -p "$IMAGES_DIR"
  "$HACK_DIR/build-image.sh" --tag "$DRIVER_IMAGE_TAG" --output "$out.partial" >"$CACHE_ROOT/build-driver-image.log" 2>&1 ||
    { tail -n 30 "$CACHE_ROOT/build-driver-image.log" >&2; die "driver image build failed (log: $CACHE_ROOT/build-driver-image.log)"; }
  mv "$out.partial" "$out"
  # Keep only the newest few archives.
  find "$IMAGES_DIR" -maxdepth 1 -name 'driver-*.oci.tar' -printf '%T@ %p\n' | sort -rn | tail -n +4 | cut -d' ' -f2- | xargs -r rm -f
}

import_image() { # <archive> <name>
  ctr_node images import --platform linux/amd64 "$1" >/dev/null 2>"$LOG_DIR/ctr-import.err" ||
    ctr_node images import --local --platform linux/amd64 "$1" >/dev/null 2>>"$LOG_DIR/ctr-import.err" ||
    { cat "$LOG_DIR/ctr-import.err" >&2; die "ctr images import $1 failed"; }
  local names
  names=$(ctr_node images ls -q)
  grep -qx "$2" <<<"$names" || die "image $2 missing after importing $1"
}

# Builds what is missing and imports all three images (pause first: a pod sandbox
# without it would try to pull, which fails offline).
ensure_images() {
  build_pause_image
  build_busybox_image
  if [[ ${GPU_DRA_SKIP_DRIVER_IMAGE:-0} != 1 ]]; then build_driver_image; fi
  local t0
  t0=$(date +%s)
  import_image "$IMAGES_DIR/pause.oci.tar" "$PAUSE_IMAGE"
  import_image "$IMAGES_DIR/busybox.oci.tar" "$BUSYBOX_IMAGE"
  if [[ ${GPU_DRA_SKIP_DRIVER_IMAGE:-0} != 1 ]]; then
    local driver_name
    driver_name=$(normalize_image_name "$DRIVER_IMAGE_TAG")
    import_image "$DRIVER_IMAGE_ARCHIVE" "$driver_name"
    ctr_node images tag --force "$driver_name" "${driver_name%:*}:$DRIVER_IMAGE_SRC_TAG" >/dev/null ||
      die "ctr images tag $driver_name ${driver_name%:*}:$DRIVER_IMAGE_SRC_TAG failed"
    printf '%s\n' "$DRIVER_IMAGE_SRC_TAG" >"$RUN_DIR/$IMPORTED_TAG_FILE"
  fi
  progress "images imported in $(( $(date +%s) - t0 ))s: $(ctr_node images ls -q | grep -v '^sha256:' | tr '\n' ' ')"
}

normalize_image_name() {
  local name=$1 first=${1%%/*}
  if [[ $name == */* && ( $first == *.* || $first == *:* || $first == localhost ) ]]; then
    printf '%s' "$name"
  elif [[ $name == */* ]]; then
    printf 'docker.io/%s' "$name"
  else
    printf 'docker.io/library/%s' "$name"
  fi
}
