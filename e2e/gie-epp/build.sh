#!/usr/bin/env bash
# Builds the Gateway API Inference Extension's own endpoint picker, the full EPP of
# sigs.k8s.io/gateway-api-inference-extension/cmd/epp at v1.3.0 (pinned by go.mod and go.sum
# here, as the module's `tool`), into $REPO/.cache/gie-epp/bin/gie-epp. The e2e tests run it
# behind the test gateway (e2e/gateway) to prove the gateway faithful to GIE's own picker.
exec "$(dirname "${BASH_SOURCE[0]}")/../build_go.sh" gie-epp "~3 minutes" \
    sigs.k8s.io/gateway-api-inference-extension/cmd/epp
