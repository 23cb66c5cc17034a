#!/usr/bin/env bash
# The real-GPU tier (tests/gpu) on a GPU host that cannot reach a package registry:
# `pack` gathers, on a machine that can, everything the tier needs beside the
# repository; `run` installs it on the GPU host and runs the tier there.
#
#   hack/gpu-tier-bundle.sh pack DIR        wheels + tools into DIR (needs network)
#   hack/gpu-tier-bundle.sh run DIR [ARGS]  install DIR's wheels, run pytest tests/gpu ARGS
#   hack/gpu-tier-bundle.sh exec DIR CMD... install them, run CMD in that environment
#                                           (hack/gpu-tier-mps.sh runs its checks so)
#
# pack: the packages the tier needs (hack/bundle_requirements.py derives them from the
# lock, pyproject.toml and what driver/ and tests/gpu/ import; it runs in the project's
# venv, which pack makes first) as wheels for the GPU host's CPython
# (GPU_PYTHON_VERSION, default 3.12; pip checks every file against the lock's sha256),
# and a tar of the tools the container test needs: nvidia-cdi-hook, nvidia-ctk and
# gpu-dra-cdi-common (hack/build-nvidia-tools.sh) and runc with the libseccomp it links
# (make cluster-build).
# run: pip installs the wheels into a directory of their own (--no-index: nothing is
# fetched), unpacks the tools into a cache laid out as the builds lay theirs out
# (GPU_DRA_CACHE), prints what the host has (driver, GPUs and MIG modes, device nodes,
# where nvidia-smi and libnvidia-ml are) and runs the tier with the host's python3.
# Nothing is written outside DIR and a temporary directory, which run removes.
set -euo pipefail

REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=hack/versions.env
source "$REPO_DIR/hack/versions.env"
CACHE_ROOT=${GPU_DRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-driver}
TOOLKIT_DIR=bin/nvidia-toolkit-$NVIDIA_CTK_VERSION
RUNC_DIR=bin/containerd-$CONTAINERD_VERSION-runc-$RUNC_VERSION
die() {
  printf 'gpu-tier-bundle: %s\n' "$*" >&2
  exit 1
}

pack() {
  local dir=$1 python_version=${GPU_PYTHON_VERSION:-3.12} tools stage
  mkdir -p "$dir/wheels"
  make -C "$REPO_DIR" --no-print-directory venv >&2
  "$REPO_DIR/.venv/bin/python" "$REPO_DIR/hack/bundle_requirements.py" >"$dir/requirements.txt"
  printf 'gpu-tier-bundle: %s packages from requirements.lock (hack/bundle_requirements.py --why)\n' \
    "$(grep -c '^[a-z0-9]' "$dir/requirements.txt")"
  python3 -m pip download --quiet --no-deps --require-hashes --only-binary=:all: \
    --implementation cp --python-version "$python_version" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    -d "$dir/wheels" -r "$dir/requirements.txt"
  tools=$("$REPO_DIR/hack/build-nvidia-tools.sh" | tail -n 1)
  [[ -x $CACHE_ROOT/$RUNC_DIR/runc ]] || die "$CACHE_ROOT/$RUNC_DIR/runc missing: run make cluster-build"
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' RETURN
  mkdir -p "$stage/$TOOLKIT_DIR" "$stage/$RUNC_DIR" "$stage/lib"
  cp -p "$tools"/{nvidia-cdi-hook,nvidia-ctk,gpu-dra-cdi-common} "$stage/$TOOLKIT_DIR/"
  cp -p "$CACHE_ROOT/$RUNC_DIR/runc" "$stage/$RUNC_DIR/"
  cp -L "$(ldd "$CACHE_ROOT/$RUNC_DIR/runc" | awk '/libseccomp/ {print $3}')" "$stage/lib/"
  tar -C "$stage" -cJf "$dir/tools.tar.xz" .
  du -sh "$dir"
}

host_facts() {
  printf '== host\n'
  uname -r
  cat /proc/driver/nvidia/version 2>/dev/null || echo "no /proc/driver/nvidia/version"
  nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,memory.total,mig.mode.current,driver_version \
    --format=csv 2>&1 || true
  printf 'nvidia-smi: %s\n' "$(command -v nvidia-smi || echo none on PATH)"
  ldconfig -p | grep -E 'libnvidia-ml|libcuda\.so' || echo "libnvidia-ml not in the ld cache"
  ls -l /dev/nvidia* 2>&1 || true
  python3 --version
}

# DIR's wheels and tools installed into a temporary directory (removed on exit), and
# the environment that runs the tier with them; the host's facts printed.
install() {
  local dir=$1
  [[ -d $dir/wheels && -f $dir/tools.tar.xz ]] || die "$dir is not a bundle (pack it first)"
  dir=$(cd "$dir" && pwd)
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT
  python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
    --target "$WORK/site" "$dir"/wheels/*.whl
  mkdir -p "$WORK/cache"
  tar -C "$WORK/cache" -xJf "$dir/tools.tar.xz"
  # runc's libseccomp where the host has none of its own.
  ldconfig -p | grep -q 'libseccomp\.so\.2' || export LD_LIBRARY_PATH=$WORK/cache/lib
  export GPU_DRA_CACHE=$WORK/cache PYTHONPATH=$WORK/site:$REPO_DIR PYTHONDONTWRITEBYTECODE=1
  host_facts
  cd "$REPO_DIR"
}

run() {
  install "$1"
  shift
  printf '== tier\n'
  python3 -m pytest -p no:cacheprovider tests/gpu "$@"
}

run_command() {
  install "$1"
  shift
  # Not exec: the EXIT trap removes the temporary directory afterwards.
  "$@"
}

case ${1:-} in
  pack) [[ $# -eq 2 ]] || die "usage: $0 pack DIR"; pack "$2" ;;
  run) [[ $# -ge 2 ]] || die "usage: $0 run DIR [PYTEST_ARGS...]"; run "${@:2}" ;;
  exec) [[ $# -ge 3 ]] || die "usage: $0 exec DIR COMMAND..."; run_command "${@:2}" ;;
  *) die "usage: $0 pack DIR | run DIR [PYTEST_ARGS...] | exec DIR COMMAND..." ;;
esac
