#!/usr/bin/env bash
# Builds one Go program of the e2e harness, e2e/NAME (pinned in its go.mod), into
# $REPO/.cache/NAME/bin/NAME. Skipped when the binary is newer than its sources.
# Usage: e2e/build_go.sh NAME "how long a first build takes" [PACKAGE]
# PACKAGE (default: the module's own main package) may name a `tool` of the module's go.mod.
set -euo pipefail

NAME="$1"
FIRST_BUILD="${2:-a few minutes}"
PACKAGE="${3:-.}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/$NAME" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
OUT="$REPO/.cache/$NAME/bin/$NAME"

export GOTOOLCHAIN=local
export CGO_ENABLED=0
export GOFLAGS="${GOFLAGS:-} -mod=readonly -buildvcs=false"

if [[ -x "$OUT" && -z "$(find "$HERE" -newer "$OUT" -type f -print -quit)" ]]; then
    echo "$NAME/build.sh: up to date: $OUT" >&2
    exit 0
fi
echo "$NAME/build.sh: building $OUT (the first build takes $FIRST_BUILD)" >&2
cd "$HERE"
go build -o "$OUT.tmp" "$PACKAGE"
mv "$OUT.tmp" "$OUT"
