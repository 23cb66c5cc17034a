#!/usr/bin/env bash
# The MPS checks of the real-GPU tier (tests/gpu), in order, in one run of about ten
# minutes on a GPU with MIG mode off (docs/gpu-testing.md, "The MPS run"):
#
#   hack/gpu-tier-mps.sh [--bundle DIR] [--budget SECONDS] [--results FILE]
#
#   --bundle DIR     run with the tier bundle DIR (hack/gpu-tier-bundle.sh pack DIR)
#                    on a host without the project's venv; else the venv's Python
#   --budget S       the whole run's time, default 600: each check gets at most its
#                    own limit and what is left; one that would start with less than
#                    MIN_CHECK seconds left is not run (and is listed so)
#   --results FILE   the short results file, default build/gpu-tier-mps-results.txt
#
# It prints `[i/n mm:ss of mm:ss] check` before each check and its outcome after, and
# writes the results file: the host, each check's outcome and seconds, the numbers
# the tests record (`RECORD` lines), and what was put back. It never changes MIG mode.
# Before the first check it saves each GPU's compute mode and time-slice interval
# (tests/gpu/tier_settings.py); on exit, however it ends, a trap stops every MPS
# control daemon the checks started and left (found by the pipe directory in their
# environment: under this run's temporary directories), then sets back any compute
# mode or interval that differs, and says if MIG mode changed.
set -euo pipefail

REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUDGET=600
BUNDLE=
RESULTS=$REPO_DIR/build/gpu-tier-mps-results.txt
MIN_CHECK=20
die() {
  printf 'gpu-tier-mps: %s\n' "$*" >&2
  exit 2
}

while [[ $# -gt 0 ]]; do
  case $1 in
    --bundle) BUNDLE=${2:?}; shift 2 ;;
    --budget) BUDGET=${2:?}; shift 2 ;;
    --results) RESULTS=${2:?}; shift 2 ;;
    *) die "usage: $0 [--bundle DIR] [--budget SECONDS] [--results FILE]" ;;
  esac
done
[[ $BUDGET =~ ^[0-9]+$ ]] || die "--budget takes whole seconds, got $BUDGET"
case $RESULTS in /*) ;; *) RESULTS=$PWD/$RESULTS ;; esac

# With a bundle: run this script again inside its environment (wheels, tools).
if [[ -n $BUNDLE && -z ${GPU_TIER_MPS_IN_BUNDLE:-} ]]; then
  export GPU_TIER_MPS_IN_BUNDLE=1
  exec "$REPO_DIR/hack/gpu-tier-bundle.sh" exec "$BUNDLE" \
    "$REPO_DIR/hack/gpu-tier-mps.sh" --budget "$BUDGET" --results "$RESULTS"
fi

cd "$REPO_DIR"
if [[ -n ${GPU_TIER_MPS_IN_BUNDLE:-} ]]; then
  PYTHON=python3
elif [[ -x .venv/bin/python ]]; then
  PYTHON=.venv/bin/python
else
  PYTHON=python3
fi

# name|pytest selection|its own limit in seconds: the tests written without a GPU
# after those that ran on one, the containers last (the longest).
CHECKS=(
  "limits of one daemon's clients|tests/gpu/test_mps.py|60"
  "the daemon pod's entrypoint|tests/gpu/test_mps_daemon_pod.py|60"
  "odd partition read back|tests/gpu/test_mps_processes.py::test_a_partition_of_an_odd_number_of_mib_is_read_back_exactly|60"
  "three processes of one share|tests/gpu/test_mps_processes.py::test_three_processes_of_one_share_are_each_held_to_its_limits|60"
  "client after a revived daemon|tests/gpu/test_mps_processes.py::test_a_client_started_after_its_daemon_was_killed_and_revived_is_limited|60"
  "uid 1000 client|tests/gpu/test_mps_processes.py::test_a_client_of_uid_1000_reaches_the_daemon_and_is_limited|60"
  "escape under cooperative|tests/gpu/test_mps_escape.py::test_a_process_outside_mps_is_reported_under_cooperative_mode|60"
  "escape under strict|tests/gpu/test_mps_escape.py::test_a_process_outside_mps_is_refused_under_strict_mode|60"
  "strict partitions share one server|tests/gpu/test_mps_strict_partitions.py|90"
  "two busy shares against one|tests/gpu/test_mps_throughput.py|90"
  "two claims in two containers|tests/gpu/test_mps_containers.py|120"
)

START=$SECONDS
RUN=$(mktemp -d /tmp/gpu-dra-tier-mps.XXXXXX)
SAVED=$RUN/settings.json
mkdir -p "$(dirname "$RESULTS")"
: >"$RESULTS"

clock() {
  printf '%d:%02d' $(($1 / 60)) $(($1 % 60))
}

note() {
  printf '%s\n' "$*" | tee -a "$RESULTS"
}

# The pids of the MPS control daemons and servers whose pipe directory is one of this
# run's (under $RUN, or a uid test's /tmp/gpu-dra-tier-uid-*), each with that directory.
our_daemons() {
  local environ pid pipe comm
  for environ in /proc/[0-9]*/environ; do
    pid=${environ#/proc/}
    pid=${pid%/environ}
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || continue
    [[ $comm == nvidia-cuda-mps* ]] || continue
    pipe=$(tr '\0' '\n' <"$environ" 2>/dev/null | sed -n 's/^CUDA_MPS_PIPE_DIRECTORY=//p') || continue
    case $pipe in "$RUN"/* | /tmp/gpu-dra-tier-uid-*) printf '%s %s %s\n' "$pid" "$comm" "$pipe" ;; esac
  done
}

cleanup() {
  local status=$? pid comm pipe left
  set +e
  note "== cleanup"
  while read -r pid comm pipe; do
    [[ $comm == nvidia-cuda-mps-control ]] || continue
    note "stopping MPS control daemon $pid ($pipe)"
    printf 'quit -t 5\n' | CUDA_MPS_PIPE_DIRECTORY=$pipe timeout 30 nvidia-cuda-mps-control >/dev/null 2>&1
  done < <(our_daemons)
  sleep 1
  while read -r pid comm pipe; do
    note "killing $comm $pid ($pipe), still running"
    kill -KILL "$pid" 2>/dev/null
  done < <(our_daemons)
  if [[ -f $SAVED ]]; then
    left=$(PYTHONPATH=${PYTHONPATH:-$REPO_DIR} "$PYTHON" -m tests.gpu.tier_settings restore "$SAVED" 2>&1)
    note "$left"
  fi
  note "total $(clock $((SECONDS - START)))"
  rm -rf "$RUN" /tmp/gpu-dra-tier-uid-* 2>/dev/null
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

note "== host"
note "$(nvidia-smi --query-gpu=index,name,uuid,memory.total,compute_mode,mig.mode.current,driver_version --format=csv,noheader 2>&1)"
note "$(PYTHONPATH=${PYTHONPATH:-$REPO_DIR} "$PYTHON" -m tests.gpu.tier_settings save "$SAVED" 2>&1)"
[[ -f $SAVED ]] || die "cannot read the GPUs' settings with nvidia-smi: nothing run"
note "== checks (budget $(clock "$BUDGET"))"

total=${#CHECKS[@]}
i=0
failed=0
for check in "${CHECKS[@]}"; do
  i=$((i + 1))
  IFS='|' read -r name selection limit <<<"$check"
  used=$((SECONDS - START))
  left=$((BUDGET - used))
  if ((left < MIN_CHECK)); then
    note "[$i/$total $(clock "$used") of $(clock "$BUDGET")] $name: not run (budget spent)"
    continue
  fi
  ((limit > left)) && limit=$left
  printf '[%d/%d %s of %s] %s (at most %ds)\n' "$i" "$total" "$(clock "$used")" "$(clock "$BUDGET")" "$name" "$limit"
  log=$RUN/check-$i.log
  began=$SECONDS
  set +e
  PYTHONPATH=${PYTHONPATH:-$REPO_DIR} timeout --signal=INT --kill-after=15 "$limit" \
    "$PYTHON" -m pytest -p no:cacheprovider -q -rs -s --basetemp="$RUN/pytest-$i" "$selection" \
    >"$log" 2>&1
  status=$?
  set -e
  took=$((SECONDS - began))
  summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error)' "$log" | tail -n 1 | tr -d '=' | xargs)
  case $status in
    0) outcome=${summary:-passed} ;;
    124 | 137) outcome="timed out after ${limit}s" ;;
    *) outcome="FAILED (exit $status) ${summary}" ;;
  esac
  [[ $status -eq 0 ]] || failed=$((failed + 1))
  note "[$i/$total] $name: $outcome (${took}s)"
  grep -E '^SKIPPED' "$log" | sed 's/^/    /' | tee -a "$RESULTS" || true
  grep -oE 'RECORD .*' "$log" | sed 's/^RECORD /    /' | tee -a "$RESULTS" || true
  if [[ $status -ne 0 ]]; then
    grep -E '^(E |FAILED)' "$log" | head -n 12 | sed 's/^/    /' | tee -a "$RESULTS" || true
    cp "$log" "${RESULTS%.txt}-check-$i.log"
  fi
done
note "== $failed of $total checks failed"
((failed == 0))
