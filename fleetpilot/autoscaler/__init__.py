"""SLO-driven autoscaling of every tier and role of an InferenceService.

- :mod:`fleetpilot.autoscaler.policy`: the pure decision, ``decide(observation, spec, history,
  now) -> Decision``; no I/O, no clock, no hidden state.
- :mod:`fleetpilot.autoscaler.prometheus`: reads what :func:`decide` needs from Prometheus,
  behind the :class:`~fleetpilot.autoscaler.prometheus.MetricsSource` protocol.
- :mod:`fleetpilot.autoscaler.actuator`: applies and records decisions (Deployment scale
  subresource, status, Events, metrics), behind the ``Actuator`` protocol.
- :mod:`fleetpilot.autoscaler.loop`: one ``tick`` over a service's roles, wiring the three.

Nothing is imported here eagerly, so that importing the pure policy never pulls in an HTTP or
Kubernetes client.
"""
