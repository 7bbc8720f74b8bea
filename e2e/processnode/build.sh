#!/usr/bin/env bash
# Builds the process node agent (a virtual-kubelet provider, pinned in go.mod) into
# $REPO/.cache/processnode/bin/processnode. The e2e tests register nodes with it that run pods
# as local processes (see main.go).
exec "$(dirname "${BASH_SOURCE[0]}")/../build_go.sh" processnode "~3 minutes"
