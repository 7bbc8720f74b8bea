#!/usr/bin/env bash
# Copies the CRDs the tests install from the modules pinned in go.mod (go.sum checks their
# hashes) into $REPO/.cache/gatewaycrds/: the Inference Extension's InferencePool
# (inference.networking.k8s.io/v1) and the Gateway API's standard-channel GatewayClass,
# Gateway and HTTPRoute. Downloads the modules once (Go's module cache); copies every time
# (a few files).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
OUT="$REPO/.cache/gatewaycrds"

export GOTOOLCHAIN=local
export GOFLAGS="${GOFLAGS:-} -mod=readonly"

cd "$HERE"
go mod download
inference="$(go list -m -f '{{.Dir}}' sigs.k8s.io/gateway-api-inference-extension)"
gateway="$(go list -m -f '{{.Dir}}' sigs.k8s.io/gateway-api)"
mkdir -p "$OUT"
install -m 0644 "$inference/config/crd/bases/inference.networking.k8s.io_inferencepools.yaml" "$OUT/"
for kind in gatewayclasses gateways httproutes; do
    install -m 0644 "$gateway/config/crd/standard/gateway.networking.k8s.io_$kind.yaml" "$OUT/"
done
echo "gatewaycrds/build.sh: CRDs in $OUT" >&2
