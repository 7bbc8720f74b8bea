"""The reference engine's command line for one planned launch, sized for a CPU.

The local runtime starts what the planner planned: each replica begins as the
:class:`~fleetpilot.engine.vllm_args.EngineLaunch` of its role (``launch_for(role)``), the same
value that becomes ``vllm serve`` in an engine pod, and this module is the one translation of
it into ``fleetpilot engine --backend reference`` flags (those of
:mod:`fleetpilot.engine.reference.settings`). Purely computational.

From the launch: the served name, the port, the batch limit, the context length, the KV-event
publisher and replay sockets (on the host, at the launch's ports) and, for a role of a
disaggregated tier, the KV connector and the ``kv_role`` the planner gives vLLM for
it (``kv_both`` with NIXL: the reference engine then takes both sides of the hand-off, as a
vLLM pod does, and the router's request parameters say which side each request is).

Capped or added for a CPU, because a laptop or CI runner runs several of these engines at once
on a few cores: a tiny seeded random model instead of the checkpoint, at most
:data:`CPU_MAX_NUM_SEQS` sequences and :data:`CPU_MAX_MODEL_LEN` tokens, a short drain on
SIGTERM (scale-downs and the end of a test wait for it), and, for P/D, the loopback address to
advertise and accept KV on.

Not taken: the model location and revision, parallelism, dtype, GPU memory, batched tokens,
KV cache block size and dtype, quantization, speculative decoding, extra vLLM arguments and,
for now, LoRA adapters (the local fleet serves a tier's base model only; issue 18).
They size or tune a GPU engine; the CPU reference engine either has no such flag or would
reject values it cannot run (an ``fp8`` KV cache), so the local fleet runs with its defaults.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import fleetpilot
from fleetpilot.engine.vllm_args import EngineLaunch, kv_events_json, kv_transfer_config

# The reference engine's smallest model preset: several engines fit on a CPU at once.
CPU_MODEL_CONFIG = "tiny"
CPU_MAX_NUM_SEQS = 16
CPU_MAX_MODEL_LEN = 2048
# Seconds running requests may finish on SIGTERM: short, as the local fleet's stops are waited on.
CPU_DRAIN_GRACE_S = 2
# The reference engine's tokenizer files as shipped (hf_tokenizer.SHIPPED), located without
# importing the engine package (which loads torch): the router of a local fleet tokenizes with
# them to match requests against the engines' KV events.
REFERENCE_TOKENIZER = Path(fleetpilot.__file__).resolve().parent / "engine/reference/tokenizer"


def reference_argv(
    launch: EngineLaunch,
    host: str,
    python: str = sys.executable,
    model_config: str = CPU_MODEL_CONFIG,
) -> list[str]:
    """``python -m fleetpilot engine --backend reference ...`` for ``launch`` on ``host``;
    ``model_config`` is the random model's architecture (a preset name or ModelConfig JSON)."""
    max_len = min(launch.max_model_len or CPU_MAX_MODEL_LEN, CPU_MAX_MODEL_LEN)
    argv = [
        *(python, "-m", "fleetpilot", "engine", "--backend", "reference"),
        *("--host", host, "--port", str(launch.port)),
        *("--model-config", model_config),
        *("--served-model-name", launch.served_name),
        *("--max-num-seqs", str(min(launch.max_num_seqs, CPU_MAX_NUM_SEQS))),
        *("--max-model-len", str(max_len)),
        *("--drain-grace-seconds", str(CPU_DRAIN_GRACE_S)),
        # A person reads these logs (crash tails, `fleetpilot up`), not a log pipeline.
        *("--log-format", "plain"),
    ]
    transfer = kv_transfer_config(launch)  # the planner's config: the same side a pod takes
    if transfer is not None:
        # Decoders pull from the host the prefill engine advertises: the loopback one.
        config = {**transfer, "kv_ip": host}
        argv += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
        # Every engine of the fleet listens on the host: KV moves only between them (engines
        # started later by the autoscaler take new ports, so the host, not host:port).
        argv += ["--allowed-remote-hosts", host]
    events = kv_events_json(launch, host)  # the planner's config, on this host's ports
    if events is not None:
        argv += ["--kv-events-config", events]
    return argv


__all__ = [
    "CPU_DRAIN_GRACE_S",
    "CPU_MAX_MODEL_LEN",
    "CPU_MAX_NUM_SEQS",
    "CPU_MODEL_CONFIG",
    "REFERENCE_TOKENIZER",
    "reference_argv",
]
