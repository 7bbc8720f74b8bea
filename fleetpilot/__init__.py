"""fleetpilot: a Kubernetes operator for autoscaled, complexity-tiered LLM inference fleets."""

__version__ = "0.1.0"
