#!/usr/bin/env bash
# Builds the test gateway (main.go: Envoy's side of ext_proc for an InferencePool) into
# $REPO/.cache/gateway/bin/gateway. The tests put an endpoint picker behind it (see main.go).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
OUT="$REPO/.cache/gateway/bin/gateway"

export GOTOOLCHAIN=local
export CGO_ENABLED=0
export GOFLAGS="${GOFLAGS:-} -mod=readonly -buildvcs=false"

if [[ -x "$OUT" && -z "$(find "$HERE" -newer "$OUT" -type f -print -quit)" ]]; then
    echo "gateway/build.sh: up to date: $OUT" >&2
    exit 0
fi
echo "gateway/build.sh: building $OUT (the first build takes ~1 minute)" >&2
cd "$HERE"
go build -o "$OUT.tmp" .
mv "$OUT.tmp" "$OUT"
