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
advertise and accept KV on. Optionally a cold start (``--cold-start-seconds``): each engine
answers /health only that long after loading, as a GPU engine loading its weights would; and
a step delay (``--step-delay-seconds``): each engine sleeps that long after every busy step, so
its throughput is set by that pace rather than by the CPU it shares with the others, and each
replica adds capacity as a GPU's would (the autoscaling benchmarks need that on two cores).

Not taken: the model location and revision, parallelism, dtype, GPU memory, batched tokens,
KV cache block size and dtype, quantization, speculative decoding and extra vLLM arguments.

LoRA: the launch's sizes, and each adapter by its name - but not from the pod's path: the
local fleet cannot download a Hub adapter or mount a PVC, so each adapter is a seeded stand-in
(``--seed-missing-lora-modules``: the engine writes one, seeded by the name, where the
folder under ``adapter_root`` is empty, and loads it from there as any adapter). A
``lora.dynamic`` tier's engines start with none and serve vLLM's load/unload endpoints; the
local fleet loads the declared list into each before it serves, as the operator does in a
cluster.
They size or tune a GPU engine; the CPU reference engine either has no such flag or would
reject values it cannot run (an ``fp8`` KV cache), so the local fleet runs with its defaults.
"""

from __future__ import annotations

import json
import sys
import zlib
from dataclasses import replace
from pathlib import Path

import fleetpilot
from fleetpilot.engine.vllm_args import (
    EngineLaunch,
    LoraLaunch,
    kv_events_json,
    kv_transfer_config,
    lora_args,
)

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
    adapter_root: Path | None = None,
    cold_start_s: float = 0.0,
    step_delay_s: float = 0.0,
) -> list[str]:
    """``python -m fleetpilot engine --backend reference ...`` for ``launch`` on ``host``;
    ``model_config`` is the random model's architecture (a preset name or ModelConfig JSON);
    ``adapter_root``: where the stand-ins of the launch's LoRA adapters live (None: the
    engine serves the base model only); ``cold_start_s``: how long each engine waits after
    loading before it reports healthy (0: none); ``step_delay_s``: how long each engine sleeps
    after every busy step (0: none)."""
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
    if launch.lora is not None and adapter_root is not None:
        argv += lora_argv(launch.lora, adapter_root)
    if cold_start_s > 0:
        argv += ["--cold-start-seconds", f"{cold_start_s:g}"]
    if step_delay_s > 0:
        argv += ["--step-delay-seconds", f"{step_delay_s:g}"]
    return argv


def adapter_stand_in(adapter_root: Path, name: str) -> Path:
    """The local folder of adapter ``name``'s stand-in: a path-safe form of the name and its
    checksum (two names never share a folder, whatever characters they hold)."""
    safe = "".join(c if c.isalnum() or c in "._-" else "-" for c in name)
    return adapter_root / f"{safe}-{zlib.crc32(name.encode('utf-8')):08x}"


def lora_argv(lora: LoraLaunch, adapter_root: Path) -> list[str]:
    """The reference engine's LoRA flags: vLLM's (``vllm_args.lora_args``) for the launch's
    sizes, its adapters as seeded stand-ins under ``adapter_root``. Adapters loaded at run
    time (``lora.dynamic``) keep the pod's paths, read under ``adapter_root`` as a container
    reads its mounts, stand-ins written there at their first load."""
    if lora.runtime_updates:
        return [
            *lora_args(lora),
            *("--adapter-path-root", str(adapter_root)),
            "--seed-missing-lora-modules",
        ]
    stand_ins = tuple((name, str(adapter_stand_in(adapter_root, name))) for name, _ in lora.modules)
    argv = lora_args(replace(lora, modules=stand_ins))
    return [*argv, "--seed-missing-lora-modules"] if stand_ins else argv


__all__ = [
    "CPU_DRAIN_GRACE_S",
    "CPU_MAX_MODEL_LEN",
    "CPU_MAX_NUM_SEQS",
    "CPU_MODEL_CONFIG",
    "REFERENCE_TOKENIZER",
    "reference_argv",
]
