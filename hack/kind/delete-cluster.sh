#!/usr/bin/env bash
# Deletes the kind cluster made by create-cluster.sh.
set -euo pipefail
# shellcheck source=hack/kind/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
need kind
kind delete cluster --name "$KIND_CLUSTER_NAME"
