#!/usr/bin/env bash
# Builds the test control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler)
# from Go modules into $REPO/.cache/controlplane/bin (or $FLEETPILOT_CONTROLPLANE_BIN).
#
# Why build instead of download: the machines reach package registries only, and a
# kube-apiserver built with a newer Go than the one it was released with has been seen serving
# broken OpenAPI. So we always build with the machine's own toolchain (GOTOOLCHAIN=local).
#
# Skips the build when every binary is newer than go.mod, go.sum, this script and the main
# packages, and was built by the same `go version`. FLEETPILOT_CONTROLPLANE_REBUILD=1 forces it.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
OUT="${FLEETPILOT_CONTROLPLANE_BIN:-$REPO/.cache/controlplane/bin}"
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler)

# The toolchain named in go.mod must be the one on the machine: never let the go command fetch
# another (see above), and build static binaries so no C toolchain is needed.
export GOTOOLCHAIN=local
export CGO_ENABLED=0
# No VCS stamping: the tree is often mid-edit, and the version is stamped by -ldflags below.
export GOFLAGS="${GOFLAGS:-} -mod=readonly -buildvcs=false"

# Must match the k8s.io/kubernetes version in go.mod: the binaries report it (kubectl version,
# /version) and client version-skew checks read it.
K8S_VERSION="$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ {print $2; exit}' "$HERE/go.mod")"

log() { echo "controlplane/build.sh: $*" >&2; }
die() { log "FAILED: $*"; exit 1; }

# What the binaries were built by and from; a change of either forces a rebuild even when the
# files' times say otherwise (e.g. the machine's Go was upgraded).
STAMP="$(go version 2>/dev/null || true) kubernetes=$K8S_VERSION"

up_to_date() {
    local bin
    [[ "$(cat "$OUT/.build-stamp" 2>/dev/null)" == "$STAMP" ]] || return 1
    for bin in "${BINARIES[@]}"; do
        [[ -x "$OUT/$bin" ]] || return 1
        if [[ -n "$(find "$HERE/go.mod" "$HERE/go.sum" "$HERE/build.sh" "$HERE/cmd" \
                    -newer "$OUT/$bin" -print -quit)" ]]; then
            return 1
        fi
    done
    return 0
}

if [[ "${FLEETPILOT_CONTROLPLANE_REBUILD:-0}" != 1 ]] && up_to_date; then
    log "up to date: $OUT"
    exit 0
fi

command -v go >/dev/null || die "step 'toolchain': no 'go' on PATH (need Go >= $(awk '$1 == "go" {print $2}' "$HERE/go.mod"))"
[[ -n "$K8S_VERSION" ]] || die "step 'version': no k8s.io/kubernetes requirement in $HERE/go.mod"
log "go: $(go version); kubernetes $K8S_VERSION; output: $OUT"

cd "$HERE"
start=$SECONDS

log "step 'module download' ..."
go mod download || die "step 'module download': 'go mod download' in $HERE (registry reachable? go.sum current?)"
log "step 'module download' done in $((SECONDS - start))s"

minor="${K8S_VERSION#v1.}"
minor="${minor%%.*}"
pkg=k8s.io/component-base/version
ldflags="-s -w -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"

# Build into a scratch folder and move into place only on success, so a failed or interrupted
# build never leaves binaries that look up to date.
mkdir -p "$OUT"
tmp="$(mktemp -d "$OUT/.build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

log "step 'compile' (the first build takes 10-25 minutes on 2 cores) ..."
cstart=$SECONDS
go build -trimpath -ldflags "$ldflags" -o "$tmp/" ./cmd/... \
    || die "step 'compile': 'go build ./cmd/...' in $HERE"
for bin in "${BINARIES[@]}"; do
    [[ -x "$tmp/$bin" ]] || die "step 'compile': $bin was not produced"
    mv -f "$tmp/$bin" "$OUT/$bin"
done
printf '%s\n' "$STAMP" > "$OUT/.build-stamp"
log "step 'compile' done in $((SECONDS - cstart))s; total $((SECONDS - start))s"
ls -l "${BINARIES[@]/#/$OUT/}" >&2
