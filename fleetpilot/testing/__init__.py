"""Test support that ships with fleetpilot: a real Kubernetes control plane on loopback.

Kept inside the package (not under tests/) so that the e2e suite, `make cluster-up` and
developers' own scripts start the cluster the same way. Import from
`fleetpilot.testing.controlplane`; this package imports nothing eagerly so that
`python -m fleetpilot.testing.controlplane` runs without a double-import warning.
"""
