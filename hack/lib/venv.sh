# shellcheck shell=bash
# The project's Python for scripts that need the locked packages (grpcio-tools,
# the driver itself). Sourced, never executed.
#
#   PYTHON=$(project_python "$REPO")
#
# PYTHON from the environment wins; otherwise `make venv` makes (or checks: a no-op
# when it is up to date) the repository's .venv first, so a script works from a fresh
# clone whichever target or script a user runs first.
project_python() {
  local repo=$1
  if [[ -n ${PYTHON:-} ]]; then
    printf '%s' "$PYTHON"
    return
  fi
  make -C "$repo" --no-print-directory venv >&2
  printf '%s' "$repo/.venv/bin/python"
}
