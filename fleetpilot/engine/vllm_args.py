"""The ``vllm serve`` command line of one engine replica. Purely computational.

:func:`launch_for` turns a tier's resolved role into an :class:`EngineLaunch`, and
:func:`vllm_serve_args` turns that into ``vllm serve`` flags. The planner puts this command into
engine pods and the launcher (``fleetpilot engine --backend vllm``) execs the same list, so what
``fleetpilot plan`` prints is exactly what runs. Flags follow vLLM's CLI (``vllm serve
--help``); JSON-valued flags are compact with sorted keys so a re-plan produces byte-identical
pod specs (no spurious rollouts).

KV events: every engine publishes its prefix-cache changes (``--kv-events-config``, vLLM's ZMQ
publisher) on :data:`KV_EVENTS_PORT` with a replay socket on :data:`KV_REPLAY_PORT`, for the
router's KV index (:mod:`fleetpilot.kv_events`). vLLM adds a data-parallel rank to both ports,
so with ``data`` ranks in a pod the replay ports start after the ``data`` event ports
(:func:`kv_event_ports` lists them all, for the pod's ports and the NetworkPolicy).

Host KV tier (``engine.kvOffload``): ``--kv-offloading-size`` (GiB, vLLM's unit, as a number
that multiplies back to the spec's bytes) and ``--kv-offloading-backend native``. With KV
events on, also ``--kv-transfer-config`` with only ``kv_connector_extra_config:
{"self_describing_kv_events": true}``: vLLM 0.33's ``VllmConfig._post_init_kv_transfer_config``
then sets the connector (OffloadingConnector), its role (``kv_both``) and ``cpu_bytes_to_use``
into that same config, keeping the extra key; without it the offloading connector publishes a
block stored in host memory as a placeholder - its hash, no token ids, no parent, block size 0
(``OffloadingEventsTracker._placeholder_stored``) - which the router cannot place in a prefix
chain. The API refuses offloading on P/D roles, whose NIXL connector vLLM would replace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from fleetpilot.api.capacity import GIB, kv_offload_bytes
from fleetpilot.api.layout import role_layout
from fleetpilot.api.spec import (
    Adapter,
    EngineBackend,
    KvConnector,
    ReferenceModel,
    ResolvedRole,
    RoleName,
    Tier,
)
from fleetpilot.kv_events import kv_events_config

ENGINE_PORT = 8000
MODEL_MOUNT = "/models"
# LoRA adapters: those from the Hub are fetched at their revision by init containers into an
# emptyDir here (vLLM would fetch a repo id itself, but at its default branch and with the
# model's token); PVCs holding adapters are mounted read-only, one directory per claim.
ADAPTER_MOUNT = "/adapters"
ADAPTER_VOLUME_MOUNT = "/adapter-volumes"
# With ``lora.dynamic`` the engine serves vLLM's load/unload endpoints (they exist only with
# this set) and starts with no adapters: the operator loads the list into running engines.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
KV_EVENTS_PORT = 5557  # vLLM's default PUB endpoint, tcp://*:5557
KV_REPLAY_PORT = 5558
# A multi-node replica (a LeaderWorkerSet group): every pod is told the group's size, its own
# index and the leader's address by environment variables the LWS controller injects, which
# the kubelet expands in the container's args (``$(NAME)``); the torch.distributed rendezvous
# and the data-parallel RPC listen on the leader at these ports (vLLM's defaults, written out
# so every pod of a group agrees whatever a vLLM release changes).
LWS_LEADER_ADDRESS = "$(LWS_LEADER_ADDRESS)"
LWS_WORKER_INDEX = "$(LWS_WORKER_INDEX)"
MASTER_PORT = 29501
DATA_PARALLEL_RPC_PORT = 29550


@dataclass(frozen=True)
class SpeculativeLaunch:
    method: str
    num_tokens: int
    model: str | None = None
    prompt_lookup_max: int | None = None


@dataclass(frozen=True)
class LoraLaunch:
    """vLLM's LoRA flags: how many adapters the engine holds, and the adapters it loads at
    start (``--lora-modules``, name and path in the pod) - none when they are loaded at run
    time (``runtime_updates``)."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int | None = None
    modules: tuple[tuple[str, str], ...] = ()
    runtime_updates: bool = False


@dataclass(frozen=True)
class EplbLaunch:
    """vLLM's expert-parallel load balancer (``--enable-eplb``, ``--eplb-config``)."""

    num_redundant_experts: int = 0
    window_size: int | None = None
    step_interval: int | None = None


@dataclass(frozen=True)
class EngineLaunch:
    """Everything ``vllm serve`` needs for one replica of one role of a tier."""

    model: str
    served_name: str
    role: RoleName = RoleName.UNIFIED
    port: int = ENGINE_PORT
    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    # Pods (nodes) one replica spans, and the data-parallel ranks each holds (None: all of
    # ``data``, in one pod); see fleetpilot.api.layout.
    nodes: int = 1
    data_local: int | None = None
    expert: bool = False
    eplb: EplbLaunch | None = None
    dtype: str = "auto"
    revision: str | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    speculative: SpeculativeLaunch | None = None
    kv_connector: str | None = None
    # The host KV tier (engine.kvOffload): bytes per engine (None: none) and vLLM's backend.
    kv_offload_bytes: int | None = None
    kv_offload_backend: str = "native"
    lora: LoraLaunch | None = None
    # KV events (module docstring): the PUB port and the replay (ROUTER) port of rank 0; None:
    # no events / no replay socket.
    kv_events_port: int | None = KV_EVENTS_PORT
    kv_replay_port: int | None = KV_REPLAY_PORT
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    # Which engine runs the launch (engine.backend); the reference engine's model preset;
    # whether the reference engine reads ``model`` at ``revision`` (a checkpoint, a Hub repo id
    # found in the Hub cache) instead of building its preset (see reference_checkpoint).
    # vllm_serve_args reads none; engine.reference_launch reads them.
    backend: EngineBackend = EngineBackend.VLLM
    reference_model: ReferenceModel = ReferenceModel.TINY
    reference_checkpoint: bool = False


def model_location(tier: Tier) -> str:
    """What vLLM loads in the pod: a path on the mounted PVC, the directory an OCI image or an
    S3 download puts the model in, else the Hub id (the operator's model cache puts an S3
    model elsewhere: operator.model_delivery)."""
    source = tier.model.source
    if source.pvc is not None:
        return f"{MODEL_MOUNT}/{source.pvc.sub_path or tier.model.name}"
    if source.oci is not None or source.s3 is not None:
        return MODEL_MOUNT
    return tier.model.name


def reference_checkpoint(tier: Tier) -> bool:
    """Whether a reference tier's engines read a checkpoint (a named Hub source, which the
    model cache's Job downloads) rather than build the seeded preset of ``referenceModel``.
    Only a named source: by default a tier's source is the Hub (``ModelSource.from_hub``), but
    a reference tier without one has always meant the preset."""
    return (
        tier.engine.backend is EngineBackend.REFERENCE and tier.model.source.huggingface is not None
    )


def adapter_dir(index: int, adapter: Adapter) -> str:
    """The directory an init container fetches a Hub adapter into: its place in the tier's
    list (names are unique, but '/' and ':' in them are not path-safe) and a readable slug."""
    slug = adapter.name.replace("/", "--").replace(":", "-")
    return f"{ADAPTER_MOUNT}/{index}-{slug}"


def adapter_claim_mount(claim: str) -> str:
    """Where a PVC holding adapters is mounted in the engine pod."""
    return f"{ADAPTER_VOLUME_MOUNT}/{claim}"


def adapter_location(index: int, adapter: Adapter, *, dynamic: bool = False) -> str:
    """Where the engine reads the tier's ``index``-th adapter in its pod. Loaded at run time
    (``dynamic``), a Hub adapter is its repo id: vLLM downloads it then (the planner admits
    only adapters that needs no revision or token of their own for)."""
    pvc = adapter.source.pvc
    if pvc is not None:
        return f"{adapter_claim_mount(pvc.claim_name)}/{pvc.path}"
    hub = adapter.source.huggingface
    if dynamic and hub is not None:
        return hub.repo
    return adapter_dir(index, adapter)


def declared_adapters(tier: Tier) -> dict[str, str]:
    """The tier's adapters, name -> where its engines read them (as ``--lora-modules`` or a
    run-time load would name them)."""
    settings = tier.lora_settings
    dynamic = settings is not None and settings.dynamic
    return {a.name: adapter_location(i, a, dynamic=dynamic) for i, a in enumerate(tier.adapters)}


def lora_launch(tier: Tier) -> LoraLaunch | None:
    """The tier's LoRA flags; None when it serves no adapters."""
    settings = tier.lora_settings
    if settings is None:
        return None
    return LoraLaunch(
        max_loras=settings.max_loras,
        max_lora_rank=settings.max_lora_rank,
        max_cpu_loras=settings.max_cpu_loras,
        modules=() if settings.dynamic else tuple(declared_adapters(tier).items()),
        runtime_updates=settings.dynamic,
    )


def launch_for(role: ResolvedRole) -> EngineLaunch:
    """The launch settings of one role (unified, prefill or decode) of a tier."""
    tier = role.tier
    parallelism = role.parallelism
    layout = role_layout(role)
    eplb = parallelism.eplb
    engine = role.engine
    spec = engine.speculative
    connector = None
    if role.disaggregated:
        kv = tier.serving.kv_transfer
        connector = (kv.connector if kv is not None else KvConnector.NIXL).value
    hf = tier.model.source.huggingface
    return EngineLaunch(
        model=model_location(tier),
        served_name=tier.model.alias,
        role=role.name,
        tensor=parallelism.tensor,
        pipeline=parallelism.pipeline,
        data=parallelism.data,
        nodes=layout.nodes,
        data_local=layout.data_local if layout.nodes > 1 else None,
        expert=parallelism.expert,
        eplb=(
            EplbLaunch(eplb.redundant_experts, eplb.window_size, eplb.step_interval)
            if eplb is not None
            else None
        ),
        dtype=tier.model.dtype.value,
        revision=hf.revision if hf is not None else None,
        max_model_len=tier.model.max_model_len,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        block_size=engine.kv_cache.block_size,
        prefix_caching=engine.kv_cache.prefix_caching,
        kv_cache_dtype=engine.kv_cache.dtype.value,
        quantization=tier.model.quantization.value if tier.model.quantization else None,
        speculative=(
            SpeculativeLaunch(
                method=spec.method.value,
                num_tokens=spec.num_tokens,
                model=spec.model,
                prompt_lookup_max=spec.prompt_lookup_max,
            )
            if spec is not None
            else None
        ),
        kv_connector=connector,
        kv_offload_bytes=kv_offload_bytes(engine),
        kv_offload_backend=(
            engine.kv_offload.backend.value if engine.kv_offload is not None else "native"
        ),
        lora=lora_launch(tier),
        kv_events_port=KV_EVENTS_PORT,
        # vLLM offsets both ports by the data-parallel rank: keep the ranges apart.
        kv_replay_port=KV_EVENTS_PORT + max(1, parallelism.data),
        extra_args=tuple(engine.extra_args),
        backend=engine.backend,
        reference_model=engine.reference_model,
        reference_checkpoint=reference_checkpoint(tier),
    )


def _compact_json(value: dict[str, object]) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def kv_events_json(launch: EngineLaunch, host: str = "*") -> str | None:
    """``--kv-events-config`` binding ``host`` (``*``: every interface); None without events."""
    if launch.kv_events_port is None:
        return None
    replay = None
    if launch.kv_replay_port is not None:
        replay = f"tcp://{host}:{launch.kv_replay_port}"
    return _compact_json(kv_events_config(f"tcp://{host}:{launch.kv_events_port}", replay))


def kv_event_ports(launch: EngineLaunch) -> list[tuple[str, int]]:
    """Named ports of the KV-event sockets of every data-parallel rank of a replica."""
    ports: list[tuple[str, int]] = []
    for name, base in (("kv-events", launch.kv_events_port), ("kv-replay", launch.kv_replay_port)):
        if base is None or launch.kv_events_port is None:
            continue
        ports += [(name if r == 0 else f"{name}-{r}", base + r) for r in range(launch.data)]
    return ports


def kv_role(connector: str, role: RoleName) -> str:
    # NIXL moves blocks in both directions from one config; the NCCL and LMCache connectors
    # are told which side of the hand-off they are.
    if connector == KvConnector.NIXL.value:
        return "kv_both"
    return "kv_producer" if role is RoleName.PREFILL else "kv_consumer"


def offload_gib(offload_bytes: int) -> str:
    """``--kv-offloading-size``: GiB, ``64`` or ``0.5``; vLLM multiplies it by 2**30 back into
    ``cpu_bytes_to_use``, exactly (the shortest decimal that reads as this binary float)."""
    gib = offload_bytes / GIB
    return str(int(gib)) if gib.is_integer() else repr(gib)


def kv_transfer_config(launch: EngineLaunch) -> dict[str, object] | None:
    """vLLM's ``--kv-transfer-config``: a P/D role's connector and side; for a host KV tier
    whose engine publishes KV events, the offloading connector's self-describing events
    (module docstring); None for a unified role without both."""
    config: dict[str, object] = {}
    if launch.kv_connector is not None:
        config["kv_connector"] = launch.kv_connector
        config["kv_role"] = kv_role(launch.kv_connector, launch.role)
    if launch.kv_offload_bytes is not None and launch.kv_events_port is not None:
        config["kv_connector_extra_config"] = {"self_describing_kv_events": True}
    return config or None


def kv_offload_args(launch: EngineLaunch) -> list[str]:
    """vLLM's host KV tier flags (none without one)."""
    if launch.kv_offload_bytes is None:
        return []
    return [
        "--kv-offloading-size",
        offload_gib(launch.kv_offload_bytes),
        "--kv-offloading-backend",
        launch.kv_offload_backend,
    ]


def multi_node_args(launch: EngineLaunch, worker: bool) -> list[str]:
    """vLLM's multi-node flags for one pod of a LeaderWorkerSet group.

    Every pod names the group's size (``--nnodes``), its own index and the leader, where
    torch.distributed meets and the data-parallel coordinator listens (the data-parallel
    address defaults to ``--master-addr``). From these vLLM cuts the replica itself: with one
    data-parallel rank spanning nodes (tensor x pipeline > GPUs per node) each pod runs its
    slice of the workers; with data-parallel ranks spread over nodes, pod ``i`` runs ranks
    ``i x dataLocal ...`` (vLLM infers the start rank from ``--node-rank``). The leader serves
    the API; workers run ``--headless``. The leader's index is always 0.
    """
    args = [
        "--nnodes",
        str(launch.nodes),
        "--node-rank",
        LWS_WORKER_INDEX if worker else "0",
        "--master-addr",
        LWS_LEADER_ADDRESS,
        "--master-port",
        str(MASTER_PORT),
    ]
    if launch.data > 1:
        args += ["--data-parallel-rpc-port", str(DATA_PARALLEL_RPC_PORT)]
    if worker:
        args.append("--headless")
    return args


def eplb_config(eplb: EplbLaunch) -> dict[str, object]:
    """``--eplb-config``: what the spec sets, vLLM's defaults for the rest."""
    config: dict[str, object] = {"num_redundant_experts": eplb.num_redundant_experts}
    if eplb.window_size is not None:
        config["window_size"] = eplb.window_size
    if eplb.step_interval is not None:
        config["step_interval"] = eplb.step_interval
    return config


def vllm_serve_args(
    launch: EngineLaunch, host: str | None = None, *, worker: bool = False
) -> list[str]:
    """Arguments after ``vllm serve``: the model first, then flags in a fixed order.

    ``host``: the one address the HTTP server and the KV-event sockets bind; None (a pod):
    every interface. A local fleet binds loopback, as its other processes do. ``worker``: the
    line of a multi-node replica's worker pods (``launch.nodes > 1``), not its leader's.
    """
    args = [
        launch.model,
        "--served-model-name",
        launch.served_name,
        "--host",
        host or "0.0.0.0",
        "--port",
        str(launch.port),
        "--tensor-parallel-size",
        str(launch.tensor),
        "--pipeline-parallel-size",
        str(launch.pipeline),
    ]
    if launch.data > 1:
        # One endpoint for every rank of the replica: vLLM balances across them.
        args += [
            "--data-parallel-size",
            str(launch.data),
            "--data-parallel-size-local",
            str(launch.data_local or launch.data),
        ]
        if launch.lora is not None and launch.lora.runtime_updates and not worker:
            # vLLM 0.33 starts one API server per rank by default, and refuses to start with
            # VLLM_ALLOW_RUNTIME_LORA_UPDATING and more than one (entrypoints/cli/serve.py):
            # the load endpoint must reach the one server that knows every adapter. A
            # headless worker runs none, and vLLM refuses the flag there.
            args += ["--api-server-count", "1"]
    if launch.nodes > 1:
        args += multi_node_args(launch, worker)
    if launch.expert:
        args += ["--enable-expert-parallel"]
    if launch.eplb is not None:
        args += ["--enable-eplb", "--eplb-config", _compact_json(eplb_config(launch.eplb))]
    args += ["--dtype", launch.dtype]
    if launch.revision:
        args += ["--revision", launch.revision]
    if launch.max_model_len is not None:
        args += ["--max-model-len", str(launch.max_model_len)]
    args += [
        "--gpu-memory-utilization",
        f"{launch.gpu_memory_utilization:g}",
        "--max-num-seqs",
        str(launch.max_num_seqs),
    ]
    if launch.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(launch.max_num_batched_tokens)]
    args += [
        "--block-size",
        str(launch.block_size),
        "--enable-prefix-caching" if launch.prefix_caching else "--no-enable-prefix-caching",
        "--kv-cache-dtype",
        launch.kv_cache_dtype,
    ]
    if launch.quantization:
        args += ["--quantization", launch.quantization]
    if launch.speculative is not None:
        spec: dict[str, object] = {
            "method": launch.speculative.method,
            "num_speculative_tokens": launch.speculative.num_tokens,
        }
        if launch.speculative.model:
            spec["model"] = launch.speculative.model
        if launch.speculative.prompt_lookup_max is not None:
            spec["prompt_lookup_max"] = launch.speculative.prompt_lookup_max
        args += ["--speculative-config", _compact_json(spec)]
    if launch.lora is not None:
        args += lora_args(launch.lora)
    args += kv_offload_args(launch)
    transfer = kv_transfer_config(launch)
    if transfer is not None:
        args += ["--kv-transfer-config", _compact_json(transfer)]
    events = kv_events_json(launch, host or "*")
    if events is not None:
        args += ["--kv-events-config", events]
    args += list(launch.extra_args)
    return args


def lora_args(lora: LoraLaunch) -> list[str]:
    """``--enable-lora`` and its sizes, then the adapters to load at start as ``name=path``
    (vLLM's older form, which it splits at the first '='; names cannot hold one)."""
    args = [
        "--enable-lora",
        "--max-loras",
        str(lora.max_loras),
        "--max-lora-rank",
        str(lora.max_lora_rank),
    ]
    if lora.max_cpu_loras is not None:
        args += ["--max-cpu-loras", str(lora.max_cpu_loras)]
    if lora.modules:
        args += ["--lora-modules", *(f"{name}={path}" for name, path in lora.modules)]
    return args
