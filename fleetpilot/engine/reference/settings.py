"""The reference engine's command line: its flags, what they mean, and the model presets.

Flags mirror ``vllm serve``'s where one exists, so the planner's engine settings read the same
on both backends. :func:`settings_from_args` turns parsed flags into the server's settings and an
engine factory, refusing a bad combination with a :class:`ConfigError` that names the flag; it
reads JSON-valued flags (``--model-config``, ``--speculative-config``, vLLM's
``--kv-transfer-config`` and ``--kv-events-config``) inline or from a file. LoRA takes vLLM's
flags (``--enable-lora``, ``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras``,
``--lora-modules``) and its ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` environment variable.
The host tier of the KV cache takes vLLM's ``--kv-offloading-size`` (GiB) and
``--kv-offloading-backend native``, the keys of ``kv_connector_extra_config`` vLLM's native CPU
offloading reads (what this engine does not do is refused, by name), and the reference engine's
own ``--kv-offload-gb-per-second``: the bandwidth that paces its copies.
``--model`` is a checkpoint folder or, as for vLLM, a Hub repo id read from a Hub cache
offline (``--revision``, ``--download-dir`` or ``HF_HUB_CACHE``: hub_cache.py), resolved here
so a repo the cache lacks fails the start. Nothing here builds the model: the server does that
after it starts listening, so its port answers 503 meanwhile, and for ``--cold-start-seconds``
longer.
Logging takes every process's flags (fleetpilot.logs: ``--log-level``, ``--log-format``, JSON
lines by default).
"""

from __future__ import annotations

import argparse
import logging
import os
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, Literal

from fleetpilot import files
from fleetpilot.api import RoleName
from fleetpilot.argtypes import port_number
from fleetpilot.engine.reference.checkpoint import load_checkpoint
from fleetpilot.engine.reference.engine import DEFAULT_KV_CACHE_BYTES, EngineConfig, LLMEngine
from fleetpilot.engine.reference.hub_cache import (
    ModelNotCachedError,
    NotARepoIdError,
    hub_cache_dir,
    resolve_snapshot,
)
from fleetpilot.engine.reference.kv_publisher import KVEventsConfig
from fleetpilot.engine.reference.lora import SUPPORTED_RANKS, LoRAConfig
from fleetpilot.engine.reference.lora_serving import (
    RUNTIME_UPDATING_ENV,
    LoRAModulePath,
    parse_lora_module,
    runtime_updating_allowed,
)
from fleetpilot.engine.reference.model import LlamaModel, ModelConfig
from fleetpilot.engine.reference.offload import DEFAULT_BANDWIDTH_BYTES_PER_S, OffloadConfig
from fleetpilot.engine.reference.peers import LOOPBACK, AllowedPeers
from fleetpilot.engine.reference.speculative import SpeculativeConfig
from fleetpilot.httpserver import ServerLimits
from fleetpilot.logs import add_log_arguments

log = logging.getLogger(__name__)

# Model presets that run on a CPU. "tiny" answers in milliseconds (tests, the local fleet);
# "small" is the engine's default architecture.
MODEL_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
    ),
    "small": ModelConfig(),
}
DEFAULT_MAX_MODEL_LEN = 2048

# vLLM's kv_both: one engine that both pins KV for decoders and pulls it from prefills. The API
# has no such role (a tier is unified, or split into prefill and decode replicas), so the
# engine's role is the API's RoleName or this.
BOTH: Final = "both"
EngineRole = RoleName | Literal["both"]


@dataclass(frozen=True)
class KVTransferSettings:
    """What ``--kv-transfer-config`` (vLLM's JSON) means for this engine."""

    role: EngineRole = RoleName.UNIFIED
    engine_id: str = ""
    advertise_host: str | None = None  # kv_ip: the host decoders should pull from
    # KV sources and callers of /internal/kv: the hand-off is unauthenticated (see pd.py)
    allowed_remote_hosts: AllowedPeers = LOOPBACK
    pull_timeout_s: float = 10.0
    pin_ttl_s: float = 60.0

    @property
    def produces(self) -> bool:
        """Pins a prompt's KV for a decoder when a request asks (``do_remote_decode``)."""
        return self.role in (RoleName.PREFILL, BOTH)

    @property
    def consumes(self) -> bool:
        """Pulls a prompt's KV from a prefill when a request names one (``do_remote_prefill``)."""
        return self.role in (RoleName.DECODE, BOTH)


@dataclass(frozen=True)
class ServerSettings:
    served_model_names: tuple[str, ...]
    model_root: str
    max_model_len: int
    host: str = "127.0.0.1"
    port: int = 8000
    kv: KVTransferSettings = KVTransferSettings()
    # KV events: off unless --kv-events-config enables them
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    drain_grace_s: float = 25.0
    step_delay_s: float = 0.0
    # Seconds between the model being loaded and /health answering 200 (a GPU engine's start).
    cold_start_s: float = 0.0
    limits: ServerLimits = field(default_factory=ServerLimits)  # header timeout, connections
    lora: LoRAConfig | None = None  # --enable-lora and its limits
    lora_modules: tuple[LoRAModulePath, ...] = ()  # adapters loaded at start
    # The local fleet's stand-ins: write a seeded adapter where an adapter path is empty.
    seed_missing_lora_modules: bool = False
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING: the load/unload endpoints exist
    allow_runtime_lora_updating: bool = False

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


class ConfigError(ValueError):
    """Bad command-line settings; the message says which flag."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The reference engine's flags; names mirror ``vllm serve``'s where one exists."""
    a = parser.add_argument
    a("--host", default="0.0.0.0", help="address to listen on (default: all interfaces)")
    a("--port", type=port_number, default=8000, help="port to listen on; 0 picks a free one")
    a(
        "--model",
        default=None,
        help="checkpoint directory (config.json + model.safetensors), or a Hub repo id "
        "(ORG/NAME) read from the Hub cache offline (--download-dir, else $HF_HUB_CACHE; "
        "nothing is downloaded); omitted: a seeded random model of --model-config",
    )
    a(
        "--revision",
        default=None,
        help="branch, tag or commit of a --model repo id in the Hub cache (default: main; "
        "ignored for a directory)",
    )
    a(
        "--download-dir",
        default=None,
        help="the Hub cache folder a --model repo id is read from (default: $HF_HUB_CACHE, "
        "else huggingface_hub's default)",
    )
    a(
        "--model-config",
        default="small",
        help="architecture of the random model: a preset (tiny, small), a JSON object of "
        "ModelConfig fields, or a JSON file (ignored with --model)",
    )
    a(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float64"],
        help="weight and activation dtype (auto: the model config's)",
    )
    a(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use in 'model'; the first is the metrics' model_name "
        "(default: --model, or reference-<preset>)",
    )
    a("--max-model-len", type=int, default=None, help="context length (default: 2048 or less)")
    a("--max-num-seqs", type=int, default=64, help="most sequences in one step")
    a("--max-num-batched-tokens", type=int, default=512, help="token budget of one step")
    a("--block-size", type=int, default=16, help="tokens per KV block")
    a(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share KV blocks of identical prompt prefixes",
    )
    a(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prefills across steps, mixed with decodes",
    )
    a("--kv-cache-dtype", choices=["auto", "int8"], default="auto", help="KV storage dtype")
    a(
        "--kv-cache-memory-bytes",
        type=int,
        default=DEFAULT_KV_CACHE_BYTES,
        help="KV pool budget in bytes",
    )
    a(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="KV pool size in blocks (overrides --kv-cache-memory-bytes)",
    )
    a(
        "--speculative-config",
        default=None,
        help='JSON: {"method": "draft_layers", "num_speculative_tokens": k, '
        '"draft_num_layers": n} (the draft is the target\'s first n layers)',
    )
    a(
        "--kv-transfer-config",
        default=None,
        help='vLLM\'s JSON, e.g. {"kv_connector": "NixlConnector", "kv_role": "kv_both"}; '
        "kv_role kv_producer/kv_consumer/kv_both enables the P/D prefill/decode/both sides; "
        "also engine_id, kv_ip (host decoders pull from) and kv_connector_extra_config "
        "{allowed_remote_hosts, pull_timeout_s}",
    )
    a(
        "--kv-events-config",
        default=None,
        help='vLLM\'s JSON, e.g. {"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}: publish prefix-cache '
        "changes (BlockStored, BlockRemoved, AllBlocksCleared) on a ZMQ PUB socket, with a "
        "ROUTER socket replaying missed batches; also buffer_steps, hwm, max_queue_size, topic "
        "(vLLM's defaults). Off by default",
    )
    a(
        "--kv-offloading-size",
        type=float,
        default=None,
        help="GiB of host memory for a second tier of KV cache, as vLLM's (its native CPU "
        "offloading): prompt blocks are copied there as they are computed, and a request "
        "whose prefix is there loads it back instead of computing it. Default: no host tier",
    )
    a(
        "--kv-offloading-backend",
        choices=["native", "lmcache"],
        default="native",
        help="vLLM's backend of --kv-offloading-size; this engine has the native one only",
    )
    a(
        "--kv-offload-gb-per-second",
        type=float,
        default=DEFAULT_BANDWIDTH_BYTES_PER_S / 1e9,
        help="reference engine only: the host tier's copy bandwidth, each way, in GB/s (1e9 "
        "bytes); a load holds its request for bytes / bandwidth. Default "
        f"{DEFAULT_BANDWIDTH_BYTES_PER_S / 1e9:g}: PCIe 4.0 x16, where a GPU's host hit costs "
        "about a tenth of its prefill; lower it to give a CPU model's slower prefill that ratio",
    )
    a(
        "--allowed-remote-hosts",
        default=None,
        help="comma-separated P/D peers: the hosts (IP, CIDR or name, optionally :port) a "
        "decode request may pull KV from, and the addresses /internal/kv answers; '*' for any "
        "(only behind a network policy). Default: loopback only (127.0.0.0/8, ::1)",
    )
    a(
        "--role",
        choices=["auto", *(role.value for role in RoleName), BOTH],
        default="auto",
        help="P/D role (auto: from kv_role, unified without --kv-transfer-config)",
    )
    a(
        "--kv-pin-ttl-seconds",
        type=float,
        default=60.0,
        help="how long a prefill keeps a prompt's KV for its decoder",
    )
    a(
        "--enable-lora",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="serve LoRA adapters (PEFT folders): a request names one in 'model'",
    )
    a("--max-loras", type=int, default=1, help="most distinct adapters in one batch")
    a(
        "--max-lora-rank",
        type=int,
        default=16,
        choices=SUPPORTED_RANKS,
        help="highest adapter rank accepted",
    )
    a(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept loaded, least recently used evicted (default: --max-loras)",
    )
    a(
        "--lora-modules",
        nargs="+",
        default=None,
        help='adapters loaded at start: name=path, or JSON {"name": ..., "path": ..., '
        '"base_model_name": ...}; set VLLM_ALLOW_RUNTIME_LORA_UPDATING=true for the '
        "load/unload endpoints",
    )
    a(
        "--seed-missing-lora-modules",
        action="store_true",
        help="reference engine only (the local fleet, which cannot download adapters): write a "
        "seeded adapter, named by its seed, at each adapter path that holds none (of "
        "--lora-modules or a run-time load), then load it from there as any other",
    )
    a(
        "--adapter-path-root",
        default=None,
        help="reference engine only (a test or local fleet playing a pod): read adapter paths "
        "(and Hub repo ids: this engine downloads nothing) under this folder, as a container "
        "sees its volume mounts",
    )
    a("--seed", type=int, default=0, help="sampling seed for requests without their own")
    a(
        "--num-threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: best for the small matrices of CPU models)",
    )
    a(
        "--drain-grace-seconds",
        type=float,
        default=25.0,
        help="on SIGTERM, how long running requests may finish before they are aborted "
        "(keep below the pod's terminationGracePeriodSeconds)",
    )
    a(
        "--step-delay-seconds",
        type=float,
        default=0.0,
        help="sleep after each busy engine step, to simulate a slower accelerator",
    )
    a(
        "--cold-start-seconds",
        type=float,
        default=0.0,
        help="reference engine only: wait this long after loading the model before /health "
        "answers 200 (503 meanwhile), to play a GPU engine's weight load and KV allocation",
    )
    add_log_arguments(parser)


def _load_json_option(flag: str, value: str) -> dict[str, Any]:
    """A JSON-valued flag, given inline or as a file, with the guards of every file an entry
    point reads (:mod:`fleetpilot.files`: size, UTF-8, nesting)."""
    source = flag  # what each message names: the flag, and its file if it names one
    try:
        if value.lstrip().startswith("{"):
            data = files.parse_json(value, flag)
        else:
            path = Path(value)
            if not path.is_file():
                raise ConfigError(f"{flag}: not a JSON object or a file: {value!r}")
            source = f"{flag}: {path}"
            data = files.load_json(path, what=f"{flag} file")
    except files.FileError as e:
        raise ConfigError(f"{source}: {e.reason}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: must be a JSON object")
    return data


def _model_config(args: argparse.Namespace) -> tuple[ModelConfig, str]:
    if args.model_config in MODEL_PRESETS:
        config, name = MODEL_PRESETS[args.model_config], f"reference-{args.model_config}"
    else:
        data = _load_json_option("--model-config", args.model_config)
        try:
            config = ModelConfig.from_json_dict(data)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"--model-config: {e}") from e
        name = "reference-custom"
    if args.dtype != "auto":
        config = replace(config, torch_dtype=args.dtype)
    return config, name


def _speculative(args: argparse.Namespace) -> SpeculativeConfig | None:
    if not args.speculative_config:
        return None
    data = _load_json_option("--speculative-config", args.speculative_config)
    method = data.pop("method", None)
    if method not in (None, "draft_layers"):
        raise ConfigError(
            f"--speculative-config: method {method!r} is not supported by the reference "
            "engine; use draft_layers (the target's first layers draft)"
        )
    allowed = {"num_speculative_tokens", "draft_num_layers"}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(
            f"--speculative-config: unknown keys {unknown}; allowed {sorted(allowed)}"
        )
    if "num_speculative_tokens" not in data:
        raise ConfigError("--speculative-config: num_speculative_tokens is required")
    try:
        return SpeculativeConfig(**data)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--speculative-config: {e}") from e


_KV_ROLES: dict[str, EngineRole] = {
    "kv_producer": RoleName.PREFILL,
    "kv_consumer": RoleName.DECODE,
    "kv_both": BOTH,
}


def _kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
    if not args.kv_transfer_config:
        return {}
    return _load_json_option("--kv-transfer-config", args.kv_transfer_config)


def _kv_settings(args: argparse.Namespace, data: Mapping[str, Any]) -> KVTransferSettings:
    role: EngineRole
    if args.role != "auto":
        role = BOTH if args.role == BOTH else RoleName(args.role)
    elif args.kv_offloading_size is not None and "kv_role" not in data:
        # Only kv_connector_extra_config, for the offloading connector: no P/D (_kv_offload).
        role = RoleName.UNIFIED
    elif data:
        kv_role = data.get("kv_role")
        if kv_role not in _KV_ROLES:
            raise ConfigError(
                f"--kv-transfer-config: kv_role must be one of {sorted(_KV_ROLES)}, got {kv_role!r}"
            )
        role = _KV_ROLES[kv_role]
    else:
        role = RoleName.UNIFIED
    extra = data.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ConfigError("--kv-transfer-config: kv_connector_extra_config must be an object")
    allowed = extra.get("allowed_remote_hosts")
    if allowed is not None and (
        not isinstance(allowed, list) or not all(isinstance(h, str) for h in allowed)
    ):
        raise ConfigError("--kv-transfer-config: allowed_remote_hosts must be a list of hosts")
    if args.allowed_remote_hosts is not None and allowed is not None:
        raise ConfigError(
            "--allowed-remote-hosts and kv_connector_extra_config.allowed_remote_hosts are "
            "both set; set one"
        )
    if args.allowed_remote_hosts is not None:
        allowed = args.allowed_remote_hosts.split(",")
    try:
        peers = LOOPBACK if allowed is None else AllowedPeers.parse(allowed)
    except ValueError as e:
        raise ConfigError(f"--allowed-remote-hosts: {e}") from e
    try:
        timeout = float(extra.get("pull_timeout_s", 10.0))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--kv-transfer-config: pull_timeout_s: {e}") from e
    if args.kv_pin_ttl_seconds <= 0:
        raise ConfigError("--kv-pin-ttl-seconds must be positive")
    engine_id = data.get("engine_id") or uuid.uuid4().hex
    kv_ip = data.get("kv_ip")
    return KVTransferSettings(
        role=role,
        engine_id=str(engine_id),
        advertise_host=str(kv_ip) if kv_ip else None,
        allowed_remote_hosts=peers,
        pull_timeout_s=timeout,
        pin_ttl_s=args.kv_pin_ttl_seconds,
    )


# The kv_connector_extra_config keys vLLM's native CPU offloading reads (offloading/config.py,
# vllm/v1/kv_offload/), each with the values this engine does as vLLM does; any other value is
# refused by name. block_size and blocks_per_chunk are checked apart (one block a chunk).
_OFFLOAD_EXTRA_SUPPORTED: Final[dict[str, tuple[object, ...]]] = {
    "eviction_policy": ("lru",),
    "store_threshold": (0, 1),  # below 2: every offered block is stored
    "max_tracker_size": (),  # any: used only with store_threshold 2 or more
    "spec_name": ("CPUOffloadingSpec",),
    "spec_module_path": (None,),
    "cache_policy_module_path": (None,),
    "secondary_tiers": (None, [], {}),
    "sync_load_budget_bytes": (0,),  # every load is asynchronous, as vLLM's default
    "canonical_layout": (False,),
    "backpressure": (None, False),
    "tier_poll_interval_s": (None,),
    "enable_telemetry": (None, False),
}
_OFFLOAD_BOOLEANS: Final = ("self_describing_kv_events", "offload_prompt_only")


def _kv_offload(
    args: argparse.Namespace, data: Mapping[str, Any], kv: KVTransferSettings
) -> OffloadConfig | None:
    """The host tier of ``--kv-offloading-size``, checked as vLLM's post-init would build it
    (``VllmConfig._post_init_kv_transfer_config``: the OffloadingConnector, kv_role kv_both,
    ``cpu_bytes_to_use`` from the size) and then by what this engine does."""
    if args.kv_offloading_size is None:
        return None
    flag = "--kv-offloading-size"
    if args.kv_offloading_backend == "lmcache":
        raise ConfigError(
            "--kv-offloading-backend lmcache: the reference engine has no LMCache server; "
            "use native (its own host tier)"
        )
    if not args.kv_offloading_size > 0:
        raise ConfigError(f"{flag} must be positive (GiB), got {args.kv_offloading_size}")
    if not args.kv_offload_gb_per_second > 0:
        raise ConfigError(
            f"--kv-offload-gb-per-second must be positive, got {args.kv_offload_gb_per_second}"
        )
    if kv.role != RoleName.UNIFIED:
        role = f"--role {args.role}" if args.role != "auto" else f"kv_role {data.get('kv_role')}"
        raise ConfigError(
            f"{flag} with a P/D role ({role}): vLLM replaces the KV connector with its "
            "offloading connector, so the P/D hand-off would be lost; offload on unified "
            "replicas only"
        )
    others = sorted(set(data) - {"kv_connector_extra_config", "engine_id"})
    if others:
        raise ConfigError(
            f"{flag}: --kv-transfer-config may carry only kv_connector_extra_config (and "
            f"engine_id) alongside it, as vLLM sets the connector and kv_role itself; got {others}"
        )
    extra = data.get("kv_connector_extra_config") or {}
    where = "--kv-transfer-config: kv_connector_extra_config"
    if "cpu_bytes_to_use" in extra:
        raise ConfigError(f"{where}.cpu_bytes_to_use: vLLM sets it from {flag}; set that instead")
    for key, allowed in _OFFLOAD_EXTRA_SUPPORTED.items():
        if key in extra and allowed and extra[key] not in allowed:
            raise ConfigError(
                f"{where}.{key} = {extra[key]!r} is not supported by the reference engine's "
                f"host tier (it does {', '.join(repr(a) for a in allowed)})"
            )
    for key in _OFFLOAD_BOOLEANS:
        if key in extra and not isinstance(extra[key], bool):
            raise ConfigError(f"{where}.{key} must be true or false, got {extra[key]!r}")
    if "blocks_per_chunk" in extra and "block_size" in extra:
        raise ConfigError(f"{where}: set one of block_size and blocks_per_chunk, as vLLM asks")
    if extra.get("blocks_per_chunk", 1) != 1 or extra.get("block_size", args.block_size) != (
        args.block_size
    ):
        chunking = {k: extra[k] for k in ("block_size", "blocks_per_chunk") if k in extra}
        raise ConfigError(
            f"{where}: {chunking} is not supported: the reference engine's host tier keeps one "
            f"KV block a chunk (blocks_per_chunk 1, block_size {args.block_size})"
        )
    if not args.enable_prefix_caching:
        raise ConfigError(
            f"{flag} needs prefix caching (the host tier keeps blocks by their prefix hashes); "
            "drop --no-enable-prefix-caching"
        )
    return OffloadConfig(
        capacity_bytes=int(args.kv_offloading_size * (1 << 30)),
        bandwidth_bytes_per_s=args.kv_offload_gb_per_second * 1e9,
        self_describing_kv_events=extra.get("self_describing_kv_events", False),
        offload_prompt_only=extra.get("offload_prompt_only", True),
    )


def _kv_events(args: argparse.Namespace) -> KVEventsConfig:
    if not args.kv_events_config:
        return KVEventsConfig()
    data = _load_json_option("--kv-events-config", args.kv_events_config)
    try:
        return KVEventsConfig.from_json_dict(data)
    except ValueError as e:
        raise ConfigError(f"--kv-events-config: {e}") from e


def _lora(args: argparse.Namespace) -> tuple[LoRAConfig | None, tuple[LoRAModulePath, ...]]:
    try:
        modules = tuple(parse_lora_module(item) for item in args.lora_modules or () if item)
    except ValueError as e:
        raise ConfigError(f"--lora-modules: {e}") from e
    if not args.enable_lora:
        if modules:
            raise ConfigError("--lora-modules needs --enable-lora")
        return None, ()
    try:
        config = LoRAConfig(
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            max_cpu_loras=args.max_cpu_loras,
            path_root=args.adapter_path_root,
        )
    except ValueError as e:
        raise ConfigError(f"--max-loras/--max-lora-rank/--max-cpu-loras: {e}") from e
    names = [m.name for m in modules]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"--lora-modules: names given twice: {duplicates}")
    return config, modules


def _checkpoint_dir(args: argparse.Namespace, env: Mapping[str, str]) -> Path:
    """The folder ``--model`` names: a directory as it is, else the snapshot of a repo id in the
    Hub cache (hub_cache.py), as vLLM resolves it with ``HF_HUB_OFFLINE=1``."""
    path = Path(args.model)
    if path.is_dir():
        return path
    cache = hub_cache_dir(args.download_dir, env)
    try:
        return resolve_snapshot(args.model, args.revision, cache)
    except NotARepoIdError as e:
        raise ConfigError(f"--model: {args.model} is not a directory, nor a Hub repo id") from e
    except ModelNotCachedError as e:
        raise ConfigError(f"--model: not a directory, and {e}") from e


def settings_from_args(
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
) -> tuple[ServerSettings, Callable[[], LLMEngine]]:
    """Settings and an engine factory from parsed flags; ConfigError for a bad combination.

    ``environ`` (default: the process's) is read for ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` and
    ``HF_HUB_CACHE``.
    The model itself is built later, by the server, so the port answers 503 meanwhile.
    """
    env = os.environ if environ is None else environ
    lora, lora_modules = _lora(args)
    kv_transfer = _kv_transfer_config(args)
    kv = _kv_settings(args, kv_transfer)
    kv_offload = _kv_offload(args, kv_transfer, kv)
    kv_events = _kv_events(args)
    spec = _speculative(args)
    model_config: ModelConfig | None = None
    checkpoint: Path | None = None
    if args.model is not None:
        checkpoint = _checkpoint_dir(args, env)
        try:
            config_data = files.load_json(checkpoint / "config.json", what="model config")
            max_positions = int(config_data.get("max_position_embeddings", 4096))
        except files.FileError as e:
            raise ConfigError(f"--model: {e}") from None
        except (AttributeError, ValueError, TypeError) as e:
            raise ConfigError(f"--model: cannot read {checkpoint / 'config.json'}: {e}") from e
        default_name = args.model
    else:
        model_config, default_name = _model_config(args)
        max_positions = model_config.max_position_embeddings
    max_model_len = args.max_model_len or min(DEFAULT_MAX_MODEL_LEN, max_positions)
    if max_model_len > max_positions:
        raise ConfigError(
            f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings "
            f"({max_positions})"
        )
    for flag, value in (
        ("--port", args.port),
        ("--drain-grace-seconds", args.drain_grace_seconds),
        ("--step-delay-seconds", args.step_delay_seconds),
        ("--cold-start-seconds", args.cold_start_seconds),
    ):
        if value < 0:
            raise ConfigError(f"{flag} must not be negative")
    try:
        engine_config = EngineConfig(
            block_size=args.block_size,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            num_kv_blocks=args.num_gpu_blocks_override,
            kv_cache_dtype=args.kv_cache_dtype,
            max_model_len=max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=args.enable_prefix_caching,
            enable_chunked_prefill=args.enable_chunked_prefill,
            speculative=spec,
            seed=args.seed,
            kv_pin_ttl_s=kv.pin_ttl_s,
            num_threads=args.num_threads,
            enable_kv_cache_events=kv_events.active,
            lora=lora,
            kv_offload=kv_offload,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from e
    names = tuple(args.served_model_name or (default_name,))
    clashes = sorted({m.name for m in lora_modules} & set(names))
    if clashes:
        raise ConfigError(f"--lora-modules: {clashes} conflict with a served base model name")
    settings = ServerSettings(
        served_model_names=names,
        model_root=args.model or default_name,
        max_model_len=max_model_len,
        host=args.host,
        port=args.port,
        kv=kv,
        kv_events=kv_events,
        drain_grace_s=args.drain_grace_seconds,
        step_delay_s=args.step_delay_seconds,
        cold_start_s=args.cold_start_seconds,
        lora=lora,
        lora_modules=lora_modules,
        seed_missing_lora_modules=args.seed_missing_lora_modules,
        allow_runtime_lora_updating=runtime_updating_allowed(env.get(RUNTIME_UPDATING_ENV)),
    )
    dtype = None if args.dtype == "auto" else args.dtype

    def factory() -> LLMEngine:
        if checkpoint is not None:
            log.info("loading the checkpoint in %s", checkpoint)
            model = load_checkpoint(checkpoint, torch_dtype=dtype)
        else:
            assert model_config is not None
            model = LlamaModel(model_config)
        return LLMEngine(engine_config, model)

    return settings, factory
