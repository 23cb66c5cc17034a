# shellcheck shell=bash
# Progress lines for long Go builds. Used by hack/lib/build.sh (etcd and the Kubernetes
# components), hack/lib/node-build.sh (containerd, runc) and hack/install-helm.sh. The
# script that sources this file must define progress() and die().
#
# A cold build compiles for minutes, or half an hour for Kubernetes, and prints nothing
# of its own. With `go build -v` or `go install -v` the log names each package as it is
# compiled. Before the build, `go list -deps` says how many packages there can be, in
# about a second once the modules are downloaded. On a cold module cache this is also
# the step where the modules are downloaded. Both counts leave out the standard
# library, which is nearly always in the Go build cache already. With a warm build
# cache the build finishes below the total, because packages it finds in the cache
# are not listed.

# Seconds between checks of a running build, and the least number of seconds between
# two progress lines. Tests shorten both.
GO_PROGRESS_POLL=${GPU_DRA_PROGRESS_POLL:-1}
GO_PROGRESS_EVERY=${GPU_DRA_PROGRESS_EVERY:-30}

# go_log_status LOG [TOTAL]: one line saying what LOG (`go build -v` output) shows so
# far: modules downloaded, packages compiled out of TOTAL, and the package compiled last.
go_log_status() {
  local log=$1 total=${2:-}
  # A compiled package's line is its import path alone. Outside the standard library
  # the first path element has a dot (k8s.io/..., github.com/...). Error lines contain
  # spaces and are not counted.
  awk -v total="$total" '
    /^go: downloading / { downloads++; next }
    /^go: / || / / { next }
    { split($0, parts, "/"); if (parts[1] ~ /\./) { compiled++; last = $0 } }
    END {
      line = ""
      if (downloads) line = downloads " modules downloaded"
      if (compiled) {
        count = total > 0 ? compiled " of at most " total : compiled
        line = (line ? line ", " : "") count " packages compiled, last: " substr(last, 1, 80)
      }
      if (line == "") line = "nothing downloaded or compiled so far (packages already in the Go build cache are not listed)"
      print line
    }' "$log" 2>/dev/null
}

# watch_go_log PID LABEL LOG [TOTAL]: prints a progress line from LOG every
# GO_PROGRESS_EVERY seconds until PID exits, then returns PID's exit status.
watch_go_log() {
  local pid=$1 label=$2 log=$3 total=${4:-} last=0
  while kill -0 "$pid" 2>/dev/null; do
    sleep "$GO_PROGRESS_POLL"
    if (( $(date +%s) - last >= GO_PROGRESS_EVERY )) && kill -0 "$pid" 2>/dev/null; then
      last=$(date +%s)
      progress "$label: $(go_log_status "$log" "$total")"
    fi
  done
  wait "$pid"
}

# run_with_progress [--total N] LABEL LOG CMD...: runs CMD with its output in LOG and
# prints progress lines while it runs. If CMD fails, prints the tail of LOG and dies.
run_with_progress() {
  local total=
  if [[ $1 == --total ]]; then total=$2; shift 2; fi
  local label=$1 log=$2; shift 2
  "$@" >"$log" 2>&1 &
  if ! watch_go_log $! "$label" "$log" "$total"; then
    tail -n 40 "$log" >&2
    die "$label failed; full log: $log"
  fi
}

# count_go_packages LABEL DIR LOG GO_LIST_ARGS...: sets GO_PACKAGES_TOTAL to the number
# of packages outside the standard library that `go list -deps GO_LIST_ARGS...` names
# in DIR, which is the most a build of those packages compiles. Any modules it needs
# are downloaded, with progress lines. Sets it to empty when go list cannot tell; the
# build that follows then reports why.
count_go_packages() {
  local label=$1 dir=$2 log=$3 list; shift 3
  list=$log.packages
  GO_PACKAGES_TOTAL=
  (cd "$dir" && exec go list -e -deps -f '{{if not .Standard}}{{.ImportPath}}{{end}}' "$@" \
    >"$list" 2>"$log") &
  if watch_go_log $! "$label" "$log"; then
    GO_PACKAGES_TOTAL=$(grep -c . "$list" || true)
    ((GO_PACKAGES_TOTAL > 0)) || GO_PACKAGES_TOTAL=
  fi
  rm -f "$list"
}

# count_module_packages LABEL MODULE@VERSION LOG GO_LIST_ARGS...: count_go_packages for
# a build by `go install <package>@<version>`. It runs in the module's own directory in
# the module cache, with the module's go.mod, as `go install` does.
count_module_packages() {
  local label=$1 module=$2 log=$3 dir; shift 3
  GO_PACKAGES_TOTAL=
  dir=$(cd / && go mod download -json "$module" 2>/dev/null |
    sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p') || return 0
  [[ -n $dir ]] || return 0
  GOFLAGS=-mod=readonly GOWORK=off count_go_packages "$label" "$dir" "$log" "$@"
}
