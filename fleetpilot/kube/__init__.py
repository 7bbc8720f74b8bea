"""Everything fleetpilot says to the Kubernetes API: the REST/SSA client, one way to connect,
the names and labels of the objects a service owns, and the field managers that own them.

The operator, the autoscaler and the router's endpoint discovery all import from here; nothing
here imports them (import-linter's layers contract in pyproject.toml holds that).
"""
