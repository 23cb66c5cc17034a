#!/usr/bin/env bash
# Generates the Python gRPC stubs in driver/proto/ from proto/.
#   hack/gen-proto.sh           regenerate
#   hack/gen-proto.sh --check   fail if the committed stubs differ from fresh ones
# The sources are staged under driver/proto/ in a temporary tree so that the generated
# modules import each other as driver.proto.<...> without rewriting.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=hack/lib/venv.sh
source "$ROOT/hack/lib/venv.sh"
PYTHON=$(project_python "$ROOT")
OUT=$ROOT/driver/proto
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

mkdir -p "$work/src/driver/proto" "$work/out"
cp -r "$ROOT/proto/." "$work/src/driver/proto/"
find "$work/src/driver/proto" -type f ! -name '*.proto' -delete
mapfile -t protos < <(cd "$work/src" && find driver/proto -name '*.proto' | sort)
(cd "$work/src" && "$PYTHON" -m grpc_tools.protoc -I . \
  --python_out="$work/out" --pyi_out="$work/out" --grpc_python_out="$work/out" "${protos[@]}")
find "$work/out/driver/proto" -type d -exec touch {}/__init__.py \;

if [[ ${1:-} == --check ]]; then
  if ! diff -r -x __pycache__ "$work/out/driver/proto" "$OUT"; then
    echo "driver/proto is out of date: run hack/gen-proto.sh" >&2
    exit 1
  fi
  echo "driver/proto is up to date"
else
  rm -rf "$OUT"
  cp -r "$work/out/driver/proto" "$OUT"
  echo "generated $(find "$OUT" -name '*_pb2*.py' | wc -l) modules in driver/proto"
fi
