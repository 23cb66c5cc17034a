#!/usr/bin/env bash
# bench/ab_state.sh REV_A REV_B [ROUNDS]: `python -m bench.profile_state --cycles 400`
# in a worktree of each revision, taking turns, ROUNDS (default 10) rounds; one line a
# run: its p50s and its process's max RSS (this tree's .venv). The worktrees are
# removed at the end.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
a=$1 b=$2 rounds=${3:-10}
tmp=$(mktemp -d)
trap 'git -C "$REPO" worktree remove --force "$tmp/a" || true; git -C "$REPO" worktree remove --force "$tmp/b" || true; rm -rf "$tmp"' EXIT
git -C "$REPO" worktree add -q --detach "$tmp/a" "$a"
git -C "$REPO" worktree add -q --detach "$tmp/b" "$b"
# The older tree may lack the RSS column: the run's own process reports it.
run='import resource, runpy, sys
sys.argv = ["bench.profile_state", "--cycles", "400"]
try:
    runpy.run_module("bench.profile_state", run_name="__main__")
except SystemExit:
    pass
print("process max RSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "KiB")'
for r in $(seq "$rounds"); do
  for side in a b; do
    rev=$([[ $side == a ]] && echo "$a" || echo "$b")
    out=$(cd "$tmp/$side" && PYTHONPATH=. "$REPO/.venv/bin/python" -c "$run" 2>/dev/null |
      grep -E '^[0-9]+ cycles|^process max RSS' | sed 's/ in [^:]*:/:/' | tr '\n' ' ')
    echo "round $r $rev: $out"
  done
done
