#!/usr/bin/env bash
# Builds the test gateway (main.go: Envoy's side of ext_proc for an InferencePool) into
# $REPO/.cache/gateway/bin/gateway. The tests put an endpoint picker behind it (see main.go).
exec "$(dirname "${BASH_SOURCE[0]}")/../build_go.sh" gateway "~1 minute"
