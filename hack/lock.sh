#!/usr/bin/env bash
# Regenerates requirements.lock: every package of pyproject.toml (with the dev extra)
# pinned to one version, each with the sha256 of every file PyPI serves for it (wheels
# for every platform and Python, and the sdist), so `pip install --require-hashes`
# accepts whichever file pip picks on the host (the venv) and in the image (Debian
# bookworm's CPython 3.11, hack/build-image.sh). pip itself is locked too (the
# Makefile's venv target upgrades to it from the lock).
#
#   hack/lock.sh              keep today's versions, refresh the hashes   (make lock)
#   hack/lock.sh --upgrade    move every unpinned package to its newest release
#   hack/lock.sh --upgrade-package NAME[==VERSION]   move one
#
# pip-tools runs in a throwaway venv (PIP_TOOLS_VERSION below), never in .venv; the
# Python used (PYTHON, default python3) must be CPython 3.11, the image's version.
set -euo pipefail

REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
PIP_VERSION=25.3
PIP_TOOLS_VERSION=7.6.2

"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' ||
  { echo "lock.sh: $PYTHON is not CPython 3.11 (the image's Python); set PYTHON=" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-dra-lock.XXXXXX")
trap 'rm -rf "$work"' EXIT
"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet --disable-pip-version-check "pip==$PIP_VERSION" "pip-tools==$PIP_TOOLS_VERSION"
printf 'pip==%s\n' "$PIP_VERSION" >"$work/pip.in"

cd "$REPO_DIR"
# The existing lock is the starting point: pip-compile keeps its pins unless told to
# upgrade, so a plain run changes hashes only.
cp requirements.lock "$work/requirements.lock"
CUSTOM_COMPILE_COMMAND="make lock" "$work/venv/bin/pip-compile" --quiet \
  --generate-hashes --allow-unsafe --strip-extras --no-emit-index-url --no-emit-find-links \
  --extra dev --output-file "$work/requirements.lock" "$@" \
  pyproject.toml "$work/pip.in"
# The temporary input file's path would otherwise appear in the "via" comments.
sed "s|$work/pip.in|hack/lock.sh (pip)|" "$work/requirements.lock" >requirements.lock
echo "lock.sh: requirements.lock written ($(grep -c '^[a-z0-9]' requirements.lock) packages)"
