"""LoRA adapters in PEFT's format: what a request names, and reading, checking and writing them.

An adapter is a folder with ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``, ``rank_pattern``/``alpha_pattern``, ...) and ``adapter_model.safetensors`` with
tensors named as PEFT names them: ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``
([r, in]) and ``...lora_B.weight`` ([out, r]). A module's delta is ``scaling * B @ A`` with
``scaling = alpha / r`` (``alpha / sqrt(r)`` under rsLoRA), per module when the patterns say so.

What is accepted follows vLLM 0.33 (``vllm/lora/peft_helper.py``, ``lora_model.py``,
``utils.py``): the same refused PEFT features with vLLM's messages, ranks up to
``--max-lora-rank``, bias ``"none"``; the tensors, not ``target_modules``, say what is adapted
(PEFT lists modules it did not find). Adaptable here: q/k/v/o and gate/up/down of every layer.
A problem is a :class:`LoRAError` naming it; a missing folder or config is the subclass
:class:`LoRANotFoundError` (vLLM answers those 404). Only safetensors is read: a pickled
``adapter_model.bin`` could run code.

:func:`adapter_weights` is purely computational (config and tensors in, the forward pass's
:class:`~fleetpilot.engine.reference.model.LoRAWeights` out); :func:`read_adapter` and
:func:`save_adapter` are the file I/O around it; :func:`random_adapter` makes seeded adapters
for tests and the local fleet.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from fleetpilot import files
from fleetpilot.engine.reference.model import (
    LoRAProjection,
    LoRATarget,
    LoRAWeights,
    ModelConfig,
    lora_targets,
)

CONFIG_FILE: Final = "adapter_config.json"
WEIGHTS_FILE: Final = "adapter_model.safetensors"
# vLLM's MaxLoRARanks: the ranks its kernels are built for.
SUPPORTED_RANKS: Final = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ALL_TARGETS: Final = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PEFT_PREFIX: Final = "base_model.model."
_BASE_EMBEDDINGS: Final = (".embed_tokens.base_layer.weight", ".lm_head.base_layer.weight")
_MODULE = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.([A-Za-z0-9_]+)$")
_GROUP = {
    m: "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp" for m in ALL_TARGETS
}
# init_lora_weights values that only set initial weights (vLLM's list): a saved adapter is then
# a plain LoRA. Others (PiSSA, OLoRA, LoftQ ...) change the base weights.
_PLAIN_INITS: Final = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")


class LoRAError(ValueError):
    """An adapter that cannot be served; the message names the problem."""


class LoRANotFoundError(LoRAError):
    """No adapter at the path: the folder or its ``adapter_config.json`` is missing."""


@dataclass(frozen=True)
class LoRAConfig:
    """The engine's LoRA limits, named after vLLM's flags (``--max-loras`` ...), with its
    defaults."""

    max_loras: int = 1  # distinct adapters in one batch (vLLM's GPU slots)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept loaded; default max_loras, as vLLM
    # Reference engine only: adapter paths are read under this folder, as a container sees its
    # volume mounts (a test or local fleet playing a pod names the pod's paths), Hub repo ids
    # included (this engine downloads nothing).
    path_root: str | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank not in SUPPORTED_RANKS:
            raise ValueError(
                f"max_lora_rank must be one of {list(SUPPORTED_RANKS)}, got {self.max_lora_rank}"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})."
            )

    @property
    def cpu_capacity(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    def files_at(self, path: str) -> Path:
        """Where an adapter named by ``path`` (as a load or --lora-modules names it) is read."""
        if self.path_root is not None:
            return Path(self.path_root) / path.lstrip("/")
        return Path(path)


@dataclass(frozen=True)
class LoRARequest:
    """An adapter as a request names it (vLLM's ``LoRARequest``): the server's registry gives
    each name an id, which keys the engine's caches."""

    name: str
    lora_int_id: int
    path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be positive, got {self.lora_int_id}")

    @property
    def hash_key(self) -> bytes:
        """What every KV block hash of its requests includes: the name and the path, as vLLM's
        ``_gen_lora_extra_hash_keys``, so a prefix under one adapter never hits under another
        (and a name re-pointed at another folder does not reuse the old one's KV)."""
        name = self.name.encode("utf-8", "surrogatepass")
        path = self.path.encode("utf-8", "surrogatepass")
        return b"lora" + len(name).to_bytes(4, "little") + name + path


@dataclass(frozen=True)
class AdapterConfig:
    """The ``adapter_config.json`` fields that decide an adapter's deltas."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str = ALL_TARGETS
    use_rslora: bool = False
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)

    @property
    def max_rank(self) -> int:
        return max([self.r, *self.rank_pattern.values()])

    def _scaling(self, rank: int, alpha: float) -> float:
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def rank_and_scaling(self, module_name: str) -> tuple[int, float]:
        """PEFT's rank and scaling for a module (``model.layers.0.self_attn.q_proj``): the
        first pattern key that is a dot-bounded suffix of the name wins, as in PEFT."""
        rank = _match(self.rank_pattern, module_name)
        alpha = _match(self.alpha_pattern, module_name)
        r = self.r if rank is None else int(rank)
        return r, self._scaling(r, self.lora_alpha if alpha is None else float(alpha))

    def to_json_dict(self, base_model: str | None = None) -> dict[str, Any]:
        """The config as PEFT writes it (the fields PEFT's loader needs, too)."""
        targets = self.target_modules
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "lora_dropout": 0.0,
            "target_modules": targets if isinstance(targets, str) else list(targets),
            "bias": "none",
            "use_rslora": self.use_rslora,
            "use_dora": False,
            "fan_in_fan_out": False,
            "inference_mode": True,
            "rank_pattern": dict(self.rank_pattern),
            "alpha_pattern": dict(self.alpha_pattern),
        }


def _match(pattern: Mapping[str, float], name: str) -> float | None:
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return None


def _refused_features(data: Mapping[str, Any]) -> list[str]:
    """vLLM's ``PEFTHelper._validate_features`` and its ``bias`` check, with its messages."""
    errors: list[str] = []
    modules_to_save = data.get("modules_to_save") or []
    unsupported = [m for m in modules_to_save if m not in ("classifier", "score")]
    if unsupported:
        errors.append(
            "vLLM only supports modules_to_save being either None or "
            f'["classifier", "score"] for classification models. Unsupported modules_to_save: '
            f"{unsupported}"
        )
    if data.get("use_dora"):
        errors.append("vLLM does not yet support DoRA.")
    if data.get("lora_bias"):
        errors.append("vLLM does not support LoRA bias (lora_bias).")
    init = data.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in _PLAIN_INITS:
        errors.append(
            f"vLLM does not support init_lora_weights={init!r}: such inits modify the base "
            "model's weights; convert the adapter to a regular LoRA."
        )
    if data.get("alora_invocation_tokens"):
        errors.append("vLLM does not support Activated LoRA (aLoRA).")
    if data.get("layer_replication"):
        errors.append("vLLM does not support layer_replication.")
    if data.get("use_bdlora"):
        errors.append("vLLM does not support block-diagonal LoRA (BD-LoRA).")
    if data.get("use_qalora"):
        errors.append("vLLM does not support QALoRA.")
    if data.get("bias", "none") != "none":
        errors.append("Adapter bias is not supported.")
    return errors


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def parse_adapter_config(data: Mapping[str, Any], *, max_lora_rank: int) -> AdapterConfig:
    """An ``adapter_config.json`` object, checked as vLLM checks it. Pure."""
    missing = sorted({"r", "lora_alpha", "target_modules"} - set(data))
    if missing:
        raise LoRAError(f"{CONFIG_FILE} lacks required fields {missing}")
    if not _positive_int(data["r"]):
        raise LoRAError(f"LoRA rank `r` must be a positive integer, got {data['r']!r}.")
    alpha = data["lora_alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise LoRAError(f"lora_alpha must be a number, got {alpha!r}")
    targets = data["target_modules"]
    if not isinstance(targets, str) and not (
        isinstance(targets, list) and all(isinstance(t, str) for t in targets)
    ):
        raise LoRAError(f"target_modules must be a list of names or a regex, got {targets!r}")
    rank_pattern = data.get("rank_pattern") or {}
    alpha_pattern = data.get("alpha_pattern") or {}
    if not isinstance(rank_pattern, dict) or not isinstance(alpha_pattern, dict):
        raise LoRAError("rank_pattern and alpha_pattern must be objects")
    for key, rank in rank_pattern.items():
        if not _positive_int(rank):
            raise LoRAError(
                f"LoRA rank for `{key}` in `rank_pattern` must be a positive integer, got {rank}."
            )
    for key, value in alpha_pattern.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise LoRAError(f"alpha for `{key}` in `alpha_pattern` must be a number")
    errors = _refused_features(data)
    config = AdapterConfig(
        r=data["r"],
        lora_alpha=float(alpha),
        target_modules=targets if isinstance(targets, str) else tuple(targets),
        use_rslora=bool(data.get("use_rslora", False)),
        rank_pattern=dict(rank_pattern),
        alpha_pattern={k: float(v) for k, v in alpha_pattern.items()},
    )
    if config.max_rank > max_lora_rank:
        errors.append(f"LoRA rank {config.max_rank} is greater than max_lora_rank {max_lora_rank}.")
    if errors:
        raise LoRAError(" ".join(errors))
    return config


def _module_of(tensor_name: str) -> tuple[str, bool]:
    """vLLM's ``parse_fine_tuned_lora_name``: (module name without PEFT's prefix, is lora_A)."""
    name = tensor_name.removeprefix(_PEFT_PREFIX)
    parts = name.split(".")
    if len(parts) >= 3 and parts[-1] == "weight" and parts[-2] in ("lora_A", "lora_B"):
        return ".".join(parts[:-2]), parts[-2] == "lora_A"
    raise LoRAError(f"{tensor_name} is unsupported LoRA weight")


def _target(module: str, config: ModelConfig, targets: Mapping[str, LoRATarget]) -> tuple[int, str]:
    """(layer, PEFT module name) of a module path, or a LoRAError saying the model lacks it."""
    m = _MODULE.match(module)
    if m is None or m.group(3) not in targets or _GROUP[m.group(3)] != m.group(2):
        raise LoRAError(
            f"the adapter targets {module}, which this model cannot adapt: LoRA applies to "
            f"model.layers.N.self_attn.{{q,k,v,o}}_proj and model.layers.N.mlp."
            "{gate,up,down}_proj"
        )
    layer = int(m.group(1))
    if layer >= config.num_hidden_layers:
        raise LoRAError(
            f"the adapter targets {module}, but the model has {config.num_hidden_layers} layers"
        )
    return layer, m.group(3)


def adapter_weights(
    adapter: AdapterConfig,
    tensors: Mapping[str, torch.Tensor],
    config: ModelConfig,
) -> LoRAWeights:
    """Check an adapter's tensors against the model and stack them for the forward pass. Pure.

    Every module needs both A [rank, in] and B [out, rank] with its rank (``r`` or its
    ``rank_pattern`` entry) and the model's sizes; B is multiplied by the module's scaling here,
    once, instead of in every forward pass.
    """
    targets = lora_targets(config)
    pairs: dict[tuple[int, str], dict[bool, tuple[str, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        if name.endswith(_BASE_EMBEDDINGS):
            continue  # PEFT saves resized embeddings beside the adapter; vLLM skips them too
        module, is_a = _module_of(name)
        pairs.setdefault(_target(module, config, targets), {})[is_a] = (name, tensor)
    if not pairs:
        raise LoRAError(f"{WEIGHTS_FILE} holds no LoRA weights")
    layers: list[dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]]] = [
        {} for _ in range(config.num_hidden_layers)
    ]
    for (layer, module), pair in sorted(pairs.items()):
        full = f"model.layers.{layer}.{_GROUP[module]}.{module}"
        if set(pair) != {True, False}:
            have, lack = ("A", "B") if True in pair else ("B", "A")
            raise LoRAError(f"{full} has lora_{have} but no lora_{lack}")
        (a_name, a), (b_name, b) = pair[True], pair[False]
        rank, scaling = adapter.rank_and_scaling(full)
        t = targets[module]
        for tname, tensor, expected in (
            (a_name, a, (rank, t.in_features)),
            (b_name, b, (t.out_features, rank)),
        ):
            if tuple(tensor.shape) != expected:
                raise LoRAError(
                    f"tensor {tname} has shape {tuple(tensor.shape)}; rank {rank} on this "
                    f"model's {module} needs {expected}"
                )
            if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
                raise LoRAError(f"tensor {tname} is not finite floating point")
        a = a.to(config.dtype)
        b = (b.to(torch.float64) * scaling).to(config.dtype)
        layers[layer].setdefault(t.projection, []).append((t.column, a, b))
    stacked: list[dict[str, LoRAProjection]] = []
    for layer_parts in layers:
        projections: dict[str, LoRAProjection] = {}
        for projection, parts in layer_parts.items():
            parts.sort(key=lambda part: part[0])
            bounds, start = [], 0
            for column, a, b in parts:
                bounds.append((start, start + a.shape[0], column, b.contiguous()))
                start += a.shape[0]
            a_all = torch.cat([a for _, a, _ in parts]).contiguous()
            projections[projection] = LoRAProjection(a_all, tuple(bounds))
        stacked.append(projections)
    return LoRAWeights(tuple(stacked))


def read_adapter(path: str | Path, config: ModelConfig, *, max_lora_rank: int) -> LoRAWeights:
    """Read and check the adapter in folder ``path`` (file I/O; see ``adapter_weights``)."""
    folder = Path(path)
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        what = "is not a folder" if not folder.is_dir() else f"has no {CONFIG_FILE}"
        raise LoRANotFoundError(f"{folder} {what}")
    try:
        data = files.load_json(config_path, what="adapter config")
    except files.FileError as e:
        raise LoRAError(f"cannot read {e}") from None
    if not isinstance(data, dict):
        raise LoRAError(f"{config_path} is not a JSON object")
    adapter = parse_adapter_config(data, max_lora_rank=max_lora_rank)
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        pickled = [n for n in ("adapter_model.bin", "adapter_model.pt") if (folder / n).is_file()]
        hint = f" ({pickled[0]} is not read: pickle can run code)" if pickled else ""
        raise LoRAError(f"{folder} has no {WEIGHTS_FILE}{hint}")
    try:
        tensors = load_file(weights_path)
    except (SafetensorError, OSError) as e:
        raise LoRAError(f"{weights_path} is not a valid safetensors file: {e}") from e
    return adapter_weights(adapter, tensors, config)


def save_adapter(
    folder: str | Path,
    adapter: AdapterConfig,
    tensors: Mapping[str, torch.Tensor],
    *,
    base_model: str | None = None,
) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT's layout)."""
    directory = Path(folder)
    directory.mkdir(parents=True, exist_ok=True)
    text = json.dumps(adapter.to_json_dict(base_model), indent=2) + "\n"
    (directory / CONFIG_FILE).write_text(text)
    weights = {name: t.detach().contiguous().clone() for name, t in tensors.items()}
    save_file(weights, directory / WEIGHTS_FILE, metadata={"format": "pt"})
    return directory


def peft_tensor_name(layer: int, module: str, matrix: str) -> str:
    """PEFT's name of one matrix (``A`` or ``B``) of a module of a layer."""
    return f"{_PEFT_PREFIX}model.layers.{layer}.{_GROUP[module]}.{module}.lora_{matrix}.weight"


def random_adapter(
    config: ModelConfig,
    rank: int,
    alpha: float,
    targets: Iterable[str] = ALL_TARGETS,
    seed: int = 0,
    *,
    strength: float = 0.5,
) -> tuple[AdapterConfig, dict[str, torch.Tensor]]:
    """A seeded adapter whose deltas are about ``strength`` times the base projections' outputs.

    PEFT starts B at zero (a trained adapter has moved it); here both factors are random, so
    the adapter visibly changes what the model says: A ~ N(0, 1/in) maps a unit activation to
    unit coordinates, B ~ N(0, 1/rank) * strength / scaling brings the delta to ``strength``
    of a base output, with the residual projections' (o, down) smaller init scale applied too.
    """
    targets = tuple(targets)
    unknown = sorted(set(targets) - set(ALL_TARGETS))
    if unknown:
        raise ValueError(f"unknown target modules {unknown}; choose from {list(ALL_TARGETS)}")
    adapter = AdapterConfig(r=rank, lora_alpha=float(alpha), target_modules=targets)
    _, scaling = adapter.rank_and_scaling("")
    gen = torch.Generator().manual_seed(seed)
    shapes = lora_targets(config)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config.num_hidden_layers):
        for module in targets:
            t = shapes[module]
            residual = config.init_residual_std if module in ("o_proj", "down_proj") else 1.0
            a = torch.randn(rank, t.in_features, generator=gen) / math.sqrt(t.in_features)
            b = torch.randn(t.out_features, rank, generator=gen) / math.sqrt(rank)
            tensors[peft_tensor_name(layer, module, "A")] = a
            tensors[peft_tensor_name(layer, module, "B")] = b * (strength * residual / scaling)
    return adapter, tensors


# Rank of the local fleet's stand-in adapters (or the engine's --max-lora-rank if lower).
SEEDED_RANK: Final = 8


def write_seeded_adapter(
    config: ModelConfig, name: str, folder: str | Path, max_rank: int
) -> Path | None:
    """A seeded stand-in for adapter ``name`` at ``folder`` unless something is there already;
    the folder written, or None. Seeded by the name, so every engine of a local fleet writes
    the same adapter, and writing into a temporary sibling renamed into place, so engines
    starting at once never read a half-written one (a rename that loses the race is fine)."""
    target = Path(folder)
    if target.exists():
        return None
    rank = min(SEEDED_RANK, max_rank)
    adapter, tensors = random_adapter(
        config, rank, 2.0 * rank, seed=zlib.crc32(name.encode("utf-8"))
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    save_adapter(staging, adapter, tensors)
    try:
        staging.rename(target)
    except OSError:  # another engine put the same adapter there first
        shutil.rmtree(staging, ignore_errors=True)
        return None
    return target
