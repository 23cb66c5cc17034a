#!/usr/bin/env bash
# Builds the gpu-dra-driver image WITHOUT Docker, as an OCI archive equivalent to
# deployments/container/Dockerfile: Debian bookworm + its Python 3.11, the package and
# its runtime dependencies (pinned by requirements.lock) in a venv at
# /opt/gpu-dra-driver, entry points on PATH, default user 65532; NVIDIA's nvidia-ctk and
# nvidia-cdi-hook (NVIDIA_CTK_VERSION in hack/versions.env) and gpu-dra-cdi-common in
# /usr/local/bin, from hack/build-nvidia-tools.sh (or GPU_DRA_NVIDIA_TOOLS_DIR, a
# directory holding the three, e.g. when root has no Go toolchain).
#
# Supply chain: no registry base image is pulled (the base is debootstrap's); the
# Release file debootstrap reads is verified against the Debian archive keyring
# (--keyring, --force-check-gpg) and every .deb against the Release file's hashes;
# DEBIAN_SNAPSHOT=20261120T000000Z builds from snapshot.debian.org at that instant
# instead of the moving bookworm suite (a reproducible base). Every Python file is downloaded with
# `pip wheel --require-hashes -r requirements.lock` (sha256 of each file, make lock),
# the package's own wheel is built offline from those verified files, and the image's
# pip installs offline from them only.
#
#   sudo hack/build-image.sh [--tag gpu-dra-driver:<version>] [--output FILE] [--refresh-base]
#                                         (default tag: pyproject.toml's version)
#   hack/build-image.sh --base-status     the cached base: where, when built, whether the
#                                         next build reuses it (no root needed)
#
# Load the result with:
#   ctr -n k8s.io images import FILE          (containerd; the real-node e2e tier)
#   docker load -i FILE                       (Docker >= 25)
#   skopeo copy oci-archive:FILE docker-daemon:gpu-dra-driver:<version>
#
# Needs: root (debootstrap and chroot), debootstrap and debian-archive-keyring
# (apt-get install debootstrap debian-archive-keyring),
# python3.11 on the host (wheels are built for the image's CPython 3.11), network to
# the Debian mirror and PyPI; go >= 1.26 and gcc for hack/build-nvidia-tools.sh unless
# GPU_DRA_NVIDIA_TOOLS_DIR is set. The Debian base (debootstrap --variant=minbase) and
# the tools are cached outside the repository, so only the first build is slow.
#
# Refreshing the base: a base from the moving suite misses every Debian security update
# published after its debootstrap, so it is rebuilt once it is older than
# GPU_DRA_BASE_MAX_AGE_DAYS (30) days, or now with --refresh-base. Each build prints the
# base's age. A DEBIAN_SNAPSHOT base is never rebuilt by age: its packages are those of
# its instant; pick a newer DEBIAN_SNAPSHOT to update it.
set -euo pipefail

HACK_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$HACK_DIR/.." && pwd)
CACHE_ROOT=${GPU_DRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-driver}
IMAGE_CACHE=$CACHE_ROOT/image
SUITE=bookworm
# A snapshot (DEBIAN_SNAPSHOT=YYYYMMDDTHHMMSSZ) pins the base's packages to one instant.
if [[ -n ${DEBIAN_SNAPSHOT:-} ]]; then
  MIRROR=https://snapshot.debian.org/archive/debian/$DEBIAN_SNAPSHOT
else
  MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
fi
KEYRING=${DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}
BASE_PACKAGES=python3,python3-venv,ca-certificates
PYTHON=${PYTHON:-python3}
# The default tag is the package's version, the chart's appVersion and image.tag default.
TAG=gpu-dra-driver:$(sed -n 's/^version = "\(.*\)"$/\1/p' "$REPO_DIR/pyproject.toml" | head -n 1)
OUTPUT=
VENV=/opt/gpu-dra-driver
BASE_MAX_AGE_DAYS=${GPU_DRA_BASE_MAX_AGE_DAYS:-30}
REFRESH_BASE=false
BASE_STATUS=false

START_TIME=$(date +%s)
progress() { printf '[build-image %4ss] %s\n' "$(( $(date +%s) - START_TIME ))" "$*"; }
die() { printf 'build-image: %s\n' "$*" >&2; exit 1; }

while (($#)); do
  case $1 in
    --tag) TAG=${2:?--tag needs a value}; shift 2 ;;
    --output) OUTPUT=${2:?--output needs a value}; shift 2 ;;
    --refresh-base) REFRESH_BASE=true; shift ;;
    --base-status) BASE_STATUS=true; shift ;;
    -h|--help) sed -n '2,/^set -euo pipefail/p' "${BASH_SOURCE[0]}" | sed '$d'; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done
[[ $TAG == *:* ]] || TAG=$TAG:latest
OUTPUT=${OUTPUT:-$IMAGE_CACHE/$(tr '/:' '__' <<<"$TAG").oci.tar}
[[ $BASE_MAX_AGE_DAYS =~ ^[0-9]+$ ]] ||
  die "GPU_DRA_BASE_MAX_AGE_DAYS must be a number of days, not '$BASE_MAX_AGE_DAYS'"

# --- The cached Debian base: which one, how old, whether to rebuild it --------------
base_key=$(printf '%s|%s|%s' "$SUITE" "$BASE_PACKAGES" "$MIRROR" | sha256sum | cut -c1-12)
BASE_DIR=$IMAGE_CACHE/base-$SUITE-$base_key
# A cached base is used only if its debootstrap verified the Release signature.
base_verified() { grep -q '^I: Valid Release signature' "$BASE_DIR/debootstrap.log" 2>/dev/null; }
base_built_at() { # epoch seconds; bases cached before built-at was written: .complete's mtime
  if [[ -s $BASE_DIR/built-at ]]; then cat "$BASE_DIR/built-at"; else stat -c %Y "$BASE_DIR/.complete"; fi
}
base_age_days() { echo $(( ($(date +%s) - $(base_built_at)) / 86400 )); }
base_built_text() { # "2026-07-01 (40 days ago)"
  printf '%s (%s days ago)' "$(date -u -d "@$(base_built_at)" +%Y-%m-%d)" "$(base_age_days)"
}
base_rebuild_reason() { # why the next build debootstraps the base anew; empty: it reuses it
  if [[ ! -f $BASE_DIR/.complete ]] || ! base_verified; then
    echo "no verified base cached"
  elif $REFRESH_BASE; then
    echo "--refresh-base"
  elif [[ -z ${DEBIAN_SNAPSHOT:-} ]] && (( $(base_age_days) > BASE_MAX_AGE_DAYS )); then
    echo "older than GPU_DRA_BASE_MAX_AGE_DAYS=$BASE_MAX_AGE_DAYS days: the moving $SUITE suite has had security updates since"
  fi
}
if $BASE_STATUS; then
  printf 'base: %s
mirror: %s
' "$BASE_DIR" "$MIRROR"
  if [[ -f $BASE_DIR/.complete ]]; then printf 'built: %s
' "$(base_built_text)"; else echo "built: never"; fi
  reason=$(base_rebuild_reason)
  if [[ -n $reason ]]; then echo "next build: rebuilds it ($reason)"; else echo "next build: reuses it"; fi
  exit 0
fi

((EUID == 0)) || die "must run as root (debootstrap and chroot); try: sudo $0"
command -v debootstrap >/dev/null || die "debootstrap missing: apt-get install -y debootstrap"
[[ -s $KEYRING ]] || die "no keyring $KEYRING to verify the Debian archive: apt-get install -y debian-archive-keyring"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' ||
  die "$PYTHON is not CPython 3.11 (the image's Debian python); set PYTHON=/path/to/python3.11"

# --- 1. Debian base rootfs (cached) -------------------------------------------------
build_base() { # <dir>: debootstrap a verified base into <dir>; non-zero on any failure
  local dir=$1
  rm -rf "$dir" && mkdir -p "$dir" || return 1
  progress "debootstrap --variant=minbase $SUITE (+ $BASE_PACKAGES) from $MIRROR into $dir, verified with $KEYRING (a few minutes)"
  debootstrap --variant=minbase --keyring="$KEYRING" --force-check-gpg --include="$BASE_PACKAGES" \
    "$SUITE" "$dir/rootfs" "$MIRROR" >"$dir/debootstrap.log" 2>&1 ||
    { tail -n 30 "$dir/debootstrap.log" >&2; return 1; }
  grep -q '^I: Valid Release signature' "$dir/debootstrap.log" ||
    { printf 'build-image: no valid Release signature reported (%s)\n' "$dir/debootstrap.log" >&2; return 1; }
  progress "adding user gpu-dra (65532) and trimming apt caches"
  env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin chroot "$dir/rootfs" /bin/sh -eu -c '
    groupadd --system --gid 65532 gpu-dra
    useradd --system --uid 65532 --gid 65532 --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin gpu-dra
    apt-get clean
    rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/*.log /var/log/apt/*
  ' || return 1
  date -u +%s >"$dir/built-at" && touch "$dir/.complete"
}
rebuild_reason=$(base_rebuild_reason)
if [[ -z $rebuild_reason ]]; then
  progress "Debian $SUITE base cached in $BASE_DIR, built $(base_built_text) ($(grep -m1 '^I: Valid Release signature' "$BASE_DIR/debootstrap.log"))"
  [[ -n ${DEBIAN_SNAPSHOT:-} ]] ||
    progress "  rebuilt when older than $BASE_MAX_AGE_DAYS days (GPU_DRA_BASE_MAX_AGE_DAYS), or now with --refresh-base"
else
  progress "building the Debian $SUITE base: $rebuild_reason"
  # Built beside the cached one, which is replaced only by a complete, verified base.
  if build_base "$BASE_DIR.new"; then
    rm -rf "$BASE_DIR"
    mv "$BASE_DIR.new" "$BASE_DIR"
  elif [[ -f $BASE_DIR/.complete ]] && base_verified; then
    progress "WARNING: the base could not be refreshed (log: $BASE_DIR.new/debootstrap.log); building from the cached one, built $(base_built_text)"
  else
    die "debootstrap of the Debian $SUITE base failed (log: $BASE_DIR.new/debootstrap.log)"
  fi
fi

# --- 2. Wheels: the package + locked runtime dependencies ---------------------------
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-dra-image.XXXXXX")
cleanup() { rm -rf "$WORK"; }
trap cleanup EXIT
mkdir -p "$WORK/wheels"
# Every locked file (runtime and dev: the lock is one file) is downloaded and checked
# against its sha256 in requirements.lock; the image installs the runtime subset below.
progress "downloading the locked wheels with $("$PYTHON" --version) (pip wheel --require-hashes -r requirements.lock)"
(cd "$REPO_DIR" && "$PYTHON" -m pip wheel --quiet --disable-pip-version-check --require-hashes \
  --wheel-dir "$WORK/wheels" -r requirements.lock) || die "pip wheel --require-hashes failed"
# The package itself (no hash possible: it is this tree), built offline: its build
# backend (setuptools) comes from the verified wheels, its dependencies are not fetched.
progress "building the gpu-dra-driver wheel offline from the verified wheels"
(cd "$REPO_DIR" && "$PYTHON" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-index \
  --find-links "$WORK/wheels" --wheel-dir "$WORK/wheels" .) || die "pip wheel . failed"
progress "$(find "$WORK/wheels" -name '*.whl' | wc -l) wheels ready"

# --- 2b. NVIDIA's CDI tools (cached) -----------------------------------------------
# nvidia-ctk and gpu-dra-cdi-common are linked dynamically against glibc (cgo): the
# image is Debian bookworm (glibc 2.36) and they are built on Debian 12 too (glibc 2.36;
# they use symbols up to GLIBC_2.34), so the image's glibc has every versioned symbol
# they need; running them in the image below checks it. nvidia-cdi-hook is static: CDI
# hooks run it on the host, outside the image.
NVIDIA_TOOLS=(nvidia-ctk nvidia-cdi-hook gpu-dra-cdi-common)
if [[ -n ${GPU_DRA_NVIDIA_TOOLS_DIR:-} ]]; then
  tools_dir=$GPU_DRA_NVIDIA_TOOLS_DIR
else
  progress "building (or finding cached) ${NVIDIA_TOOLS[*]} with hack/build-nvidia-tools.sh"
  tools_dir=$("$HACK_DIR/build-nvidia-tools.sh" | tail -n 1) || die "hack/build-nvidia-tools.sh failed"
fi
for tool in "${NVIDIA_TOOLS[@]}"; do
  [[ -x $tools_dir/$tool ]] || die "$tools_dir/$tool missing (hack/build-nvidia-tools.sh builds it)"
done
progress "NVIDIA tools from $tools_dir"

# --- 3. Install into a copy of the base --------------------------------------------
ROOTFS=$WORK/rootfs
progress "copying base rootfs"
cp -a "$BASE_DIR/rootfs" "$ROOTFS"
mkdir -p "$ROOTFS/tmp/wheels"
cp "$WORK"/wheels/*.whl "$ROOTFS/tmp/wheels/"
progress "installing gpu-dra-driver into $VENV (offline, inside the image's Python)"
env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root chroot "$ROOTFS" /bin/sh -eu -c "
  python3 -m venv $VENV
  $VENV/bin/pip install --quiet --no-index --find-links /tmp/wheels --disable-pip-version-check gpu-dra-driver
  $VENV/bin/pip uninstall --quiet --yes pip
  $VENV/bin/python -c 'import driver'
  for s in gpu-kubelet-plugin gpu-dra-webhook gpu-dra; do test -x $VENV/bin/\$s; done
  rm -rf /tmp/wheels
"
progress "installed: $(du -sh "$ROOTFS$VENV" | cut -f1) in $VENV"
mkdir -p "$ROOTFS/usr/local/bin"
for tool in "${NVIDIA_TOOLS[@]}"; do
  install -m 0755 "$tools_dir/$tool" "$ROOTFS/usr/local/bin/$tool"
done
# Run inside the image: a dynamically linked tool fails here if its glibc is too old.
env -i PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin chroot "$ROOTFS" /bin/sh -eu -c '
  nvidia-ctk --version >/dev/null
  nvidia-cdi-hook --version >/dev/null
  gpu-dra-cdi-common --help 2>&1 | grep -q -- --driver-root
' || die "the NVIDIA tools do not run inside the image (glibc too old?)"
progress "installed ${NVIDIA_TOOLS[*]} in /usr/local/bin"

# --- 4. OCI archive: base layer (cached) + app layer -------------------------------
mkdir -p "$(dirname "$OUTPUT")"
progress "writing OCI archive $OUTPUT"
"$PYTHON" - "$BASE_DIR" "$ROOTFS" "$VENV" "$TAG" "$OUTPUT" <<'PY'
"""Minimal OCI image-layout writer (also carries a docker-archive manifest.json)."""
import gzip, hashlib, io, json, os, shutil, sys, tarfile, tempfile, time

base_dir, rootfs, venv, tag, output = sys.argv[1:]
repo, ref = tag.rsplit(":", 1)
EXCLUDE_CONTENT = ("dev", "proc", "sys", "run", "tmp")

def tar_tree(root, paths, out):
    """Uncompressed layer tar of `paths` (relative to root), sorted, numeric owners."""
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tf:
        def add(rel):
            full = os.path.join(root, rel)
            ti = tf.gettarinfo(full, arcname=rel)
            ti.uname = ti.gname = ""
            if ti.isreg():
                with open(full, "rb") as fh:
                    tf.addfile(ti, fh)
            elif ti.isdir() or ti.issym() or ti.islnk():
                tf.addfile(ti)
            # device nodes, sockets and fifos are never part of the image
        for top in paths:
            add(top)
            # A top-level symlink (bin -> usr/bin on merged-/usr Debian) is stored as a
            # symlink only: walking through it would store usr/bin's files a second time
            # under bin/, which containerd cannot unpack.
            if os.path.islink(os.path.join(root, top)):
                continue
            for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
                dirnames.sort()
                rel_dir = os.path.relpath(dirpath, root)
                if rel_dir in EXCLUDE_CONTENT:
                    dirnames[:] = []
                    continue
                for name in dirnames + sorted(filenames):
                    add(os.path.join(rel_dir, name))

def compress(raw_path, blobs):
    diff = hashlib.sha256()
    tmp = os.path.join(blobs, ".layer.tmp")
    with open(raw_path, "rb") as src, open(tmp, "wb") as dst:
        with gzip.GzipFile(fileobj=dst, mode="wb", mtime=0, compresslevel=6) as gz:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                diff.update(chunk)
                gz.write(chunk)
    digest = hashlib.sha256(open(tmp, "rb").read()).hexdigest()
    os.replace(tmp, os.path.join(blobs, digest))
    return "sha256:" + diff.hexdigest(), "sha256:" + digest, os.path.getsize(os.path.join(blobs, digest))

def blob(blobs, data):
    digest = hashlib.sha256(data).hexdigest()
    with open(os.path.join(blobs, digest), "wb") as fh:
        fh.write(data)
    return "sha256:" + digest, len(data)

with tempfile.TemporaryDirectory() as layout:
    blobs = os.path.join(layout, "blobs", "sha256")
    os.makedirs(blobs)
    layers = []
    # Base layer: cached next to the base rootfs, rebuilt only when that changes.
    # (v2: symlinks stored as symlinks; v1 layers walked through bin -> usr/bin.)
    cached = os.path.join(base_dir, "layer-v2.tar.gz")
    meta = os.path.join(base_dir, "layer-v2.json")
    if not (os.path.exists(cached) and os.path.exists(meta)):
        raw = os.path.join(base_dir, "layer.tar")
        base_root = os.path.join(base_dir, "rootfs")
        tar_tree(base_root, sorted(os.listdir(base_root)), raw)
        diff_id, digest, size = compress(raw, blobs)
        shutil.copy(os.path.join(blobs, digest.split(":")[1]), cached)
        os.remove(raw)
        json.dump({"diff_id": diff_id, "digest": digest, "size": size}, open(meta, "w"))
    else:
        shutil.copy(cached, os.path.join(blobs, json.load(open(meta))["digest"].split(":")[1]))
    layers.append(json.load(open(meta)))
    # Application layer: the venv and the NVIDIA tools in /usr/local/bin.
    raw = os.path.join(layout, "app.tar")
    tar_tree(rootfs, [venv.lstrip("/").split("/")[0], "usr/local/bin"], raw)
    diff_id, digest, size = compress(raw, blobs)
    os.remove(raw)
    layers.append({"diff_id": diff_id, "digest": digest, "size": size})

    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    config = {
        "created": created, "architecture": "amd64", "os": "linux",
        "config": {
            "User": "65532:65532",
            "Env": [f"PATH={venv}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    "PYTHONDONTWRITEBYTECODE=1", "PYTHONUNBUFFERED=1"],
            "Cmd": ["gpu-dra", "--help"],
            "Labels": {"org.opencontainers.image.title": "gpu-dra-driver",
                       "org.opencontainers.image.licenses": "Apache-2.0"},
        },
        "rootfs": {"type": "layers", "diff_ids": [l["diff_id"] for l in layers]},
        "history": [{"created": created, "created_by": "debootstrap --variant=minbase bookworm"},
                    {"created": created,
                     "created_by": "hack/build-image.sh: venv " + venv + ", NVIDIA tools in /usr/local/bin"}],
    }
    cfg_digest, cfg_size = blob(blobs, json.dumps(config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": cfg_digest, "size": cfg_size},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": l["digest"], "size": l["size"]} for l in layers],
    }
    man_digest, man_size = blob(blobs, json.dumps(manifest, sort_keys=True).encode())
    first = repo.split("/")[0]
    if "/" in repo and ("." in first or ":" in first or first == "localhost"):
        full_name = repo
    elif "/" in repo:
        full_name = "docker.io/" + repo
    else:
        full_name = "docker.io/library/" + repo
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [{"mediaType": manifest["mediaType"], "digest": man_digest, "size": man_size,
                            "annotations": {"io.containerd.image.name": f"{full_name}:{ref}",
                                            "org.opencontainers.image.ref.name": ref}}]}
    json.dump(index, open(os.path.join(layout, "index.json"), "w"))
    json.dump({"imageLayoutVersion": "1.0.0"}, open(os.path.join(layout, "oci-layout"), "w"))
    # docker-archive compatibility (older `docker load`).
    json.dump([{"Config": "blobs/sha256/" + cfg_digest.split(":")[1], "RepoTags": [tag],
                "Layers": ["blobs/sha256/" + l["digest"].split(":")[1] for l in layers]}],
              open(os.path.join(layout, "manifest.json"), "w"))
    tmp_out = output + ".partial"
    with tarfile.open(tmp_out, "w") as tf:
        for name in ("oci-layout", "index.json", "manifest.json", "blobs"):
            tf.add(os.path.join(layout, name), arcname=name)
    os.replace(tmp_out, output)
    print(f"image {tag} ({full_name}:{ref}) manifest {man_digest}")
PY
progress "done: $OUTPUT ($(du -h "$OUTPUT" | cut -f1))"
