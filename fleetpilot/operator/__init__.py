"""The operator: a pure planner and (later) the kopf handlers around it."""
