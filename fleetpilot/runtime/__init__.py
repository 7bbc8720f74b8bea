"""Where a plan is realized outside Kubernetes: local processes (``fleetpilot up``)."""
