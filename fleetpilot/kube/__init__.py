"""Everything fleetpilot says to the Kubernetes API: the REST/SSA client (``client``), one way
to connect (``connect``), the names and labels of the objects a service owns (``names``), the
field managers that own their fields (``managers``) and resource quantities compared by value
(``quantity``).

The operator, the autoscaler and the router's endpoint discovery all import from here; nothing
here imports them (import-linter's layers contract in pyproject.toml holds that).
"""
