"""The engines a fleet runs, behind ``fleetpilot engine --backend vllm|reference``.

* ``vllm_args``: one engine replica's settings (:class:`~fleetpilot.engine.vllm_args.EngineLaunch`,
  from a tier's resolved role) and its ``vllm serve`` command line, which the planner puts into
  engine pods;
* ``launcher``: ``--backend vllm``, which checks the machine and then execs that same command;
* ``reference``: ``--backend reference``, a CPU engine in torch that speaks vLLM's HTTP API and
  metrics, for clusters without GPUs, the local fleet (``fleetpilot up``) and the tests.
"""
