#!/usr/bin/env bash
# Builds rhysd/actionlint, the GitHub Actions workflow checker (github.com/rhysd/actionlint,
# pinned by go.mod and go.sum here as the module's `tool`), into
# $REPO/.cache/actionlint/bin/actionlint. tests/test_release.py runs it over .github/workflows.
exec "$(dirname "${BASH_SOURCE[0]}")/../build_go.sh" actionlint "~1 minute" \
    github.com/rhysd/actionlint/cmd/actionlint
