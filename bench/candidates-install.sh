#!/usr/bin/env bash
# Installs the HTTP server libraries that `python -m bench.http_floods --candidate`
# compares (issue 42) into a directory of their own, never into .venv: they are not
# project dependencies. Every file is checked against bench/candidates.lock's sha256
# hashes (--require-hashes), one by one (--no-deps: the lock lists every dependency
# that .venv does not already hold). The candidate servers run with .venv's Python and
# PYTHONPATH=<repo>:<target>; aiohttp, the reference candidate, is in .venv already.
#
#   bench/candidates-install.sh          install (nothing to do when already installed)
#   bench/candidates-install.sh --lock   regenerate bench/candidates.lock from
#                                        bench/candidates.in (pip-tools in a throwaway
#                                        venv, shared packages held to requirements.lock)
#
# TARGET (default ~/.cache/gpu-dra-driver/bench-candidates) moves the directory.
set -euo pipefail

REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TARGET=${TARGET:-$HOME/.cache/gpu-dra-driver/bench-candidates}
PY="$REPO_DIR/.venv/bin/python"
LOCK="$REPO_DIR/bench/candidates.lock"
PIP_VERSION=25.3
PIP_TOOLS_VERSION=7.6.2

if [[ "${1:-}" == "--lock" ]]; then
  work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-dra-candidates-lock.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  echo "candidates-install: pip-tools $PIP_TOOLS_VERSION in $work"
  python3 -m venv "$work/venv"
  "$work/venv/bin/pip" install --quiet --disable-pip-version-check \
    "pip==$PIP_VERSION" "pip-tools==$PIP_TOOLS_VERSION"
  grep -E '^[A-Za-z]' "$REPO_DIR/requirements.lock" | sed 's/ *\\$//' >"$work/constraints.txt"
  cp "$REPO_DIR/bench/candidates.in" "$work/candidates.in"
  (cd "$work" && CUSTOM_COMPILE_COMMAND="bench/candidates-install.sh --lock" \
    venv/bin/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras \
    --no-emit-index-url --no-emit-find-links -c constraints.txt \
    --output-file candidates.lock candidates.in)
  sed 's|-r candidates.in|-r bench/candidates.in|; s|-c constraints.txt|-c requirements.lock|' \
    "$work/candidates.lock" >"$LOCK"
  echo "candidates-install: wrote $LOCK"
  exit 0
fi

[[ -x "$PY" ]] || { echo "candidates-install: no $PY (make venv first)" >&2; exit 1; }
stamp="$TARGET/.installed"
if [[ -f "$stamp" ]] && cmp -s "$LOCK" "$stamp"; then
  echo "candidates-install: $TARGET already holds bench/candidates.lock"
  exit 0
fi
echo "candidates-install: installing bench/candidates.lock into $TARGET"
rm -rf "$TARGET"
mkdir -p "$TARGET"
"$PY" -m pip install --disable-pip-version-check --progress-bar off --require-hashes \
  --no-deps --target "$TARGET" -r "$LOCK"
cp "$LOCK" "$stamp"
echo "candidates-install: done; run the candidates with PYTHONPATH=$REPO_DIR:$TARGET"
