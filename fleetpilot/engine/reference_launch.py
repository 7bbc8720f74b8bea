"""The reference engine's command line for one planned launch: in a pod, and on a laptop.

The one translation of the planner's :class:`~fleetpilot.engine.vllm_args.EngineLaunch` (the
value that becomes ``vllm serve`` in a vLLM pod) into ``fleetpilot engine --backend reference``
flags (those of :mod:`fleetpilot.engine.reference.settings`). Two callers, one mapping
(:func:`reference_engine_args`): the planner's pods of a tier with ``engine.backend:
reference`` (:func:`reference_pod_command`), and the local runtime's processes
(:func:`reference_argv`, ``fleetpilot up``). Purely computational.

From the launch: the served name, the port, the batch limit, the context length, the KV-event
publisher and replay sockets (at the launch's ports) and, for a role of a disaggregated tier,
the KV connector and the ``kv_role`` the planner gives vLLM for it (``kv_both`` with NIXL: the
reference engine then takes both sides of the hand-off, as a vLLM pod does, and the router's
request parameters say which side each request is), and a host KV tier (``engine.kvOffload``)
with vLLM's flags: ``--kv-offloading-size`` and ``--kv-offloading-backend``, and, while the
engine publishes KV events, the ``--kv-transfer-config`` asking for self-describing events of
blocks in host memory (one with only ``kv_connector_extra_config``: a unified engine). A
launch of a reference tier adds what
the reference engine runs as the spec says: its model - the preset (``engine.referenceModel``),
or a checkpoint (``model.source.huggingface``: ``--model <model.name>`` at ``--revision``, a
Hub repo id the engine reads from the Hub cache offline, which the pod's environment names as
a cached vLLM pod's does) -, KV block size and prefix caching, and the step token budget when
the spec sets one.

Where the two callers differ, and why:

- Binding. A pod listens on every interface (``0.0.0.0``, KV events on ``*``), advertises its
  pod IP to decoders (``$(POD_IP)``, which the kubelet expands from the pod's environment), and
  takes KV hand-offs from any peer (the service's NetworkPolicy admits only its own engines);
  a local fleet binds, advertises and admits its loopback host.
- Drain on SIGTERM: a pod's engine finishes running requests for up to
  :data:`POD_DRAIN_GRACE_S` (a rolling update must not cut replies), a local one for
  :data:`CPU_DRAIN_GRACE_S` (the local fleet's stops are waited on).
- A spec written for GPUs (``engine.backend: vllm``) is capped for a CPU locally, because a
  laptop or CI runner runs several engines at once on a few cores: a tiny seeded random model
  instead of the checkpoint, at most :data:`CPU_MAX_NUM_SEQS` sequences,
  :data:`CPU_MAX_MODEL_LEN` tokens and a host KV tier of at most
  :data:`CPU_MAX_KV_OFFLOAD_BYTES`. A reference tier is not capped: its user chose the engine
  and its preset, and the planner refused what it cannot run (the same spec runs the same
  engine flags up and in a cluster). Locally optional too: a cold start
  (``--cold-start-seconds``: each engine answers /health only that long after loading, as a
  GPU engine loading its weights would) and a step delay (``--step-delay-seconds``: each engine
  sleeps that long after every busy step, so each replica adds capacity as a GPU's would; the
  autoscaling benchmarks need that on two cores).

Not taken: parallelism, dtype, GPU memory, quantization, speculative decoding and extra vLLM
arguments (the planner refuses them for a reference tier); the model location and revision
but for a reference checkpoint; for a GPU spec run locally also the KV block size and dtype
and the step budget. A reference checkpoint is never run locally (:func:`reference_argv`
refuses it: the local fleet has no model cache to read it from, and ``fleetpilot up`` refuses
the spec first).

LoRA (local only: the planner refuses adapters for a reference tier): the launch's sizes, and
each adapter by its name - but not from the pod's path: the local fleet cannot download a Hub
adapter or mount a PVC, so each adapter is a seeded stand-in (``--seed-missing-lora-modules``:
the engine writes one, seeded by the name, where the folder under ``adapter_root`` is empty,
and loads it from there as any adapter). A ``lora.dynamic`` tier's engines start with none and
serve vLLM's load/unload endpoints; the local fleet loads the declared list into each before
it serves, as the operator does in a cluster.
"""

from __future__ import annotations

import json
import sys
import zlib
from dataclasses import replace
from pathlib import Path

import fleetpilot
from fleetpilot.api.spec import EngineBackend, ReferenceModel
from fleetpilot.engine.vllm_args import (
    EngineLaunch,
    LoraLaunch,
    kv_events_json,
    kv_offload_args,
    kv_transfer_config,
    lora_args,
)

# The reference engine's smallest model preset: several engines fit on a CPU at once.
CPU_MODEL_CONFIG = "tiny"
CPU_MAX_NUM_SEQS = 16
CPU_MAX_MODEL_LEN = 2048
# A GPU spec's host KV tier run locally: four times the reference engine's default KV pool of
# 64 MiB (--kv-cache-memory-bytes), so the host tier is larger than the device's as on a GPU
# node, while several engines of a local fleet fit in a laptop's memory (a GPU spec's tier is
# tens of GiB).
CPU_MAX_KV_OFFLOAD_BYTES = 256 * 1024 * 1024
# Seconds running requests may finish on SIGTERM: short, as the local fleet's stops are waited on.
CPU_DRAIN_GRACE_S = 2
# In a pod: long enough for any reply of these models (a 2048-token generation of the small
# preset takes seconds), well inside the pod's terminationGracePeriodSeconds (120).
POD_DRAIN_GRACE_S = 30
# Each preset's context limit: its max_position_embeddings (engine.reference.settings
# MODEL_PRESETS, which loads torch: a test holds the two equal). A reference tier's
# maxModelLen above it is refused by the planner; unset, the engine runs min(2048, this).
REFERENCE_MAX_MODEL_LEN = {ReferenceModel.TINY: 2048, ReferenceModel.SMALL: 4096}
# The context the engine runs without --max-model-len (settings.DEFAULT_MAX_MODEL_LEN), within
# the preset's limit.
REFERENCE_DEFAULT_MAX_MODEL_LEN = 2048
# The environment variable a reference pod's P/D engine advertises its address from (the
# kubelet expands $(POD_IP) in the container's args; engine_objects sets it from status.podIP).
POD_IP_ENV = "POD_IP"
# The reference engine's tokenizer files as shipped (hf_tokenizer.SHIPPED), located without
# importing the engine package (which loads torch): the router of a local fleet tokenizes with
# them to match requests against the engines' KV events.
REFERENCE_TOKENIZER = Path(fleetpilot.__file__).resolve().parent / "engine/reference/tokenizer"


def cpu_launch(launch: EngineLaunch) -> EngineLaunch:
    """What the local fleet runs of ``launch``: a reference tier's launch as planned, a GPU
    tier's capped for a CPU (the batch, the context length, the host KV tier; the model is the
    tiny preset)."""
    if launch.backend is EngineBackend.REFERENCE:
        return launch
    offload = launch.kv_offload_bytes
    return replace(
        launch,
        max_num_seqs=min(launch.max_num_seqs, CPU_MAX_NUM_SEQS),
        max_model_len=min(launch.max_model_len or CPU_MAX_MODEL_LEN, CPU_MAX_MODEL_LEN),
        kv_offload_bytes=min(offload, CPU_MAX_KV_OFFLOAD_BYTES) if offload is not None else None,
    )


def reference_engine_args(
    launch: EngineLaunch,
    host: str | None,
    model_config: str,
    drain_grace_s: float,
) -> list[str]:
    """The flags after ``fleetpilot engine`` for ``launch``, as the reference engine runs it.

    ``host``: the one address the engine binds, advertises to decoders and takes KV hand-offs
    from (a local fleet's loopback); None (a pod): every interface, the pod's IP, any peer.
    ``model_config``: the random model's architecture (a preset name or ModelConfig JSON),
    unless the launch reads a checkpoint (``launch.reference_checkpoint``).
    """
    if launch.backend is EngineBackend.REFERENCE and launch.reference_checkpoint:
        # The Hub repo id, found offline in the Hub cache the environment names (HF_HUB_CACHE),
        # as vLLM reads it in a cached tier's pod; the checkpoint's config.json is the model.
        model = ["--model", launch.model]
        model += ["--revision", launch.revision] if launch.revision else []
    else:
        model = ["--model-config", model_config]
    argv = [
        *("--backend", "reference"),
        *("--host", host or "0.0.0.0", "--port", str(launch.port)),
        *model,
        # Explicit: the engine would name itself after --model otherwise.
        *("--served-model-name", launch.served_name),
        *("--max-num-seqs", str(launch.max_num_seqs)),
    ]
    if launch.max_model_len is not None:
        argv += ["--max-model-len", str(launch.max_model_len)]
    if launch.backend is EngineBackend.REFERENCE:
        # What the spec sets that this engine runs as vLLM would: the router hashes prompt
        # blocks of this size to match the engines' KV events.
        argv += ["--block-size", str(launch.block_size)]
        argv += [
            "--enable-prefix-caching" if launch.prefix_caching else "--no-enable-prefix-caching"
        ]
        if launch.max_num_batched_tokens is not None:
            argv += ["--max-num-batched-tokens", str(launch.max_num_batched_tokens)]
    argv += [
        *("--drain-grace-seconds", f"{drain_grace_s:g}"),
        # A person reads these logs (crash tails, `fleetpilot up`, kubectl logs), not a pipeline.
        *("--log-format", "plain"),
    ]
    argv += kv_offload_args(launch)
    transfer = kv_transfer_config(launch)  # the planner's config: the same side a pod takes
    if transfer is not None and launch.kv_connector is None:
        # A unified engine's: only the host tier's self-describing KV events.
        argv += ["--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]
    elif transfer is not None:
        # Decoders pull from the host the prefill engine advertises.
        config = {**transfer, "kv_ip": host or f"$({POD_IP_ENV})"}
        argv += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
        # Locally every engine of the fleet listens on the host: KV moves only between them
        # (engines started later by the autoscaler take new ports, so the host, not
        # host:port). In a cluster the peers are pods at any address of the pod network; the
        # service's NetworkPolicy admits only its own engines to this port.
        argv += ["--allowed-remote-hosts", host or "*"]
    events = kv_events_json(launch, host or "*")  # the planner's config, on these ports
    if events is not None:
        argv += ["--kv-events-config", events]
    return argv


def reference_pod_command(launch: EngineLaunch) -> list[str]:
    """The command of a reference tier's engine container: ``fleetpilot engine`` (the
    reference image's entry point) with the launch's flags, bound as a pod binds."""
    args = reference_engine_args(launch, None, launch.reference_model.value, POD_DRAIN_GRACE_S)
    return ["fleetpilot", "engine", *args]


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
    ``model_config`` is the random model's architecture for a GPU tier's launch (a preset name
    or ModelConfig JSON; a reference tier's launch names its own preset); ``adapter_root``:
    where the stand-ins of the launch's LoRA adapters live (None: the engine serves the base
    model only); ``cold_start_s``: how long each engine waits after loading before it reports
    healthy (0: none); ``step_delay_s``: how long each engine sleeps after every busy step (0:
    none)."""
    if launch.reference_checkpoint:
        raise ValueError(
            f"{launch.served_name}: the local fleet cannot run a reference checkpoint "
            f"({launch.model}): it has no model cache to read it from"
        )
    local = cpu_launch(launch)
    if launch.backend is EngineBackend.REFERENCE:
        model_config = launch.reference_model.value
    argv = [
        *(python, "-m", "fleetpilot", "engine"),
        *reference_engine_args(local, host, model_config, CPU_DRAIN_GRACE_S),
    ]
    if local.lora is not None and adapter_root is not None:
        argv += lora_argv(local.lora, adapter_root)
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
    "CPU_MAX_KV_OFFLOAD_BYTES",
    "CPU_MAX_MODEL_LEN",
    "CPU_MAX_NUM_SEQS",
    "CPU_MODEL_CONFIG",
    "POD_DRAIN_GRACE_S",
    "POD_IP_ENV",
    "REFERENCE_DEFAULT_MAX_MODEL_LEN",
    "REFERENCE_MAX_MODEL_LEN",
    "REFERENCE_TOKENIZER",
    "cpu_launch",
    "reference_argv",
    "reference_engine_args",
    "reference_pod_command",
]
