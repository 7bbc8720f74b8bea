#!/usr/bin/env bash
# Builds the kstatus checker (main.go: sigs.k8s.io/cli-utils' kstatus, pinned in go.mod) into
# $REPO/.cache/kstatus/bin/kstatus. The e2e tests pipe live objects through it to see the
# status Flux computes for them. Skipped when the binary is newer than its sources.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
OUT="$REPO/.cache/kstatus/bin/kstatus"

export GOTOOLCHAIN=local
export CGO_ENABLED=0
export GOFLAGS="${GOFLAGS:-} -mod=readonly -buildvcs=false"

if [[ -x "$OUT" && -z "$(find "$HERE" -newer "$OUT" -type f -print -quit)" ]]; then
    echo "kstatus/build.sh: up to date: $OUT" >&2
    exit 0
fi
echo "kstatus/build.sh: building $OUT (the first build takes ~2 minutes)" >&2
cd "$HERE"
go build -o "$OUT.tmp" .
mv "$OUT.tmp" "$OUT"
