"""SLO-driven autoscaling of every tier and role of an InferenceService.

The pure core (no I/O, no clock, no hidden state; the import-linter contract keeps it so):

- :mod:`~fleetpilot.autoscaler.model`: the plain data (``Metrics``, ``Observation``,
  ``RolePolicy``, ``History``, ``Decision`` and the decision's middle steps);
- :mod:`~fleetpilot.autoscaler.policy`: the decision, ``decide(observation, spec, history,
  now) -> Decision``;
- :mod:`~fleetpilot.autoscaler.explain`: the decision's sentence, the ``reason`` that Events,
  the status and the local status table show.

Around it, the shells:

- metrics sources behind :class:`~fleetpilot.autoscaler.prometheus.MetricsSource`:
  :mod:`~fleetpilot.autoscaler.prometheus` (PromQL), :mod:`~fleetpilot.autoscaler.direct`
  (the engines' /metrics, no Prometheus) and :mod:`~fleetpilot.autoscaler.fallback` (the
  first while it answers, else the second);
- actuators behind :class:`~fleetpilot.autoscaler.actuator.Actuator`:
  :mod:`~fleetpilot.autoscaler.actuator` (a cluster: scale subresource, status, Events,
  metrics) and :mod:`~fleetpilot.autoscaler.remote` (a local fleet's control API);
- :mod:`~fleetpilot.autoscaler.loop`: one ``tick`` over a service's roles (observe, decide,
  scale, record), run by the operator's timer and by
- :mod:`~fleetpilot.autoscaler.cli`: ``fleetpilot autoscaler --fleet URL``, the process
  ``fleetpilot up`` starts for a local fleet.

Nothing is imported here eagerly, so that importing the pure modules never pulls in an HTTP or
Kubernetes client.
"""
