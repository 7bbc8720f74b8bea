#!/usr/bin/env bash
# Builds the process node agent (a virtual-kubelet provider, pinned in go.mod) into
# $REPO/.cache/processnode/bin/processnode. The e2e tests register nodes with it that run pods
# as local processes (see main.go). Skipped when the binary is newer than its sources.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
OUT="$REPO/.cache/processnode/bin/processnode"

export GOTOOLCHAIN=local
export CGO_ENABLED=0
export GOFLAGS="${GOFLAGS:-} -mod=readonly -buildvcs=false"

if [[ -x "$OUT" && -z "$(find "$HERE" -newer "$OUT" -type f -print -quit)" ]]; then
    echo "processnode/build.sh: up to date: $OUT" >&2
    exit 0
fi
echo "processnode/build.sh: building $OUT (the first build takes ~3 minutes)" >&2
cd "$HERE"
go build -o "$OUT.tmp" .
mv "$OUT.tmp" "$OUT"
