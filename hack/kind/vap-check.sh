#!/usr/bin/env bash
# Shows the chart's node-scoped ValidatingAdmissionPolicy at work with two real
# kubelets: from inside the plugin pod of one worker, with that pod's own service
# account token (which carries the pod's node), it asks the API server to create a
# ResourceSlice (server-side dry run: admission runs, nothing is stored)
#   1. for its own node and pool: must be allowed;
#   2. for the other worker's node and pool: must be refused by the policy.
# Exit 0 only when both hold. Needs at least two workers with a plugin pod each.
set -euo pipefail
# shellcheck source=hack/kind/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

[[ $# -eq 0 ]] || kind_die "usage: $0"
k() { "$KUBECTL" --context "$KUBE_CONTEXT" "$@"; }

mapfile -t plugins < <(k -n "$DRIVER_NAMESPACE" get pods -l app.kubernetes.io/component=kubeletplugin \
  --field-selector status.phase=Running -o jsonpath='{range .items[*]}{.metadata.name} {.spec.nodeName}{"\n"}{end}' | sort -k2)
((${#plugins[@]} >= 2)) || kind_die "needs two running plugin pods on two workers (KIND_WORKERS=2); found ${#plugins[@]}"
read -r pod own <<<"${plugins[0]}"
read -r _ other <<<"${plugins[1]}"
[[ $own != "$other" ]] || kind_die "both plugin pods run on $own"

# Runs in the plugin container (the image's Python; no kubectl there).
probe=$(cat <<'PY'
import json, os, ssl, sys, urllib.error, urllib.request
driver, nodes = sys.argv[1], sys.argv[2:]
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
token = open(sa + "/token").read()
ctx = ssl.create_default_context(cafile=sa + "/ca.crt")
url = "https://%s:%s/apis/resource.k8s.io/v1/resourceslices?dryRun=All" % (
    os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"])
for node in nodes:
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": "vap-check-" + node},
            "spec": {"driver": driver, "nodeName": node, "devices": [],
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}}}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": "Bearer " + token,
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=30) as resp:
            print("%s %d allowed (dry run, nothing stored)" % (node, resp.status))
    except urllib.error.HTTPError as err:
        print("%s %d %s" % (node, err.code, json.loads(err.read()).get("message", "")))
PY
)
kind_progress "from plugin pod $pod on $own (its own service account token): create a ResourceSlice, dry run"
out=$(k -n "$DRIVER_NAMESPACE" exec "$pod" -c plugin -- python3 -c "$probe" "$DRIVER_NAME" "$own" "$other") ||
  kind_die "the probe failed in $pod: $out"
own_line=$(grep "^$own " <<<"$out" || true)
other_line=$(grep "^$other " <<<"$out" || true)
printf '  for its own node   %s\n  for the other node %s\n' "$own_line" "$other_line"
[[ $own_line == "$own 201 "* ]] || kind_die "the plugin on $own may not create a slice of its own node: $own_line"
[[ $other_line == "$other 403 "*"ValidatingAdmissionPolicy"*"may not modify resourceslices on node '$other'"* ]] ||
  kind_die "the plugin on $own was not refused a slice of $other by the ValidatingAdmissionPolicy: $other_line"
kind_progress "refused by the ValidatingAdmissionPolicy, as it must be"
