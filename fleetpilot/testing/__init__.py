"""Test support that ships with fleetpilot: a real Kubernetes control plane on loopback, and a
reference engine server inside the test process (`engine_server`).

Kept inside the package (not under tests/) so that the e2e suite, `make cluster-up` and
developers' own scripts start the cluster the same way. The control plane's API is imported from
`fleetpilot.testing.controlplane`, which is built from `binaries` (the Go-built components),
`pki`, `kubeconfig`, `nodes` (fake GPU nodes) and `cluster`; `cli` is its `up`/`down` command
line. This package imports nothing eagerly, so that `python -m fleetpilot.testing.cli` runs
without a double-import warning and the control plane never imports the engine's torch.
"""
