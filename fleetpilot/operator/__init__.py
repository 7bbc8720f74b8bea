"""The operator: turns each InferenceService into the objects that serve it, and keeps them so.

- The planner (``planner``, ``engine_objects``, ``router_objects``, ``network_policy``,
  ``plan_types``, ``summary``) and the status computation (``status``) and apply decision
  (``drift``) are purely computational: a spec in, plain objects out.
- ``reconcile`` is the I/O shell around them: it applies what changed (server-side apply),
  prunes what is no longer planned and writes the status through ``fleetpilot.kube``;
  ``node_memory`` reads the cluster's Nodes (cached) so each plan is checked against the
  largest node of each GPU product.
- ``handlers`` are the kopf handlers that feed it cluster events, and the timer that runs the
  autoscaler (``fleetpilot.autoscaler``) for every service; ``metrics`` are served on
  ``/metrics`` by ``fleetpilot operator``.
"""
