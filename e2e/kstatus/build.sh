#!/usr/bin/env bash
# Builds the kstatus checker (main.go: sigs.k8s.io/cli-utils' kstatus, pinned in go.mod) into
# $REPO/.cache/kstatus/bin/kstatus. The e2e tests pipe live objects through it to see the
# status Flux computes for them.
exec "$(dirname "${BASH_SOURCE[0]}")/../build_go.sh" kstatus "~2 minutes"
