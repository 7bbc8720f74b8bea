"""Load generation for OpenAI-compatible fleets (``fleetpilot bench``)."""
